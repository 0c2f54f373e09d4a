"""Study overview: trial counts, the best trial and the Pareto front, refreshed live."""

from __future__ import annotations

import time
from typing import Any, Mapping

import streamlit as st

from dashboard import charts, context, frames


def render() -> None:
    st.title("Study overview")
    st.fragment(run_every=context.refresh_every())(_live)()


def _live() -> None:
    view = context.study()
    directions = ", ".join(f"{d.lower()} {n}" for d, n in zip(view.study.directions, view.objectives))
    st.subheader(view.study.name)
    st.caption(f"Objectives: {directions}. Read at {time.strftime('%H:%M:%S')}.")
    counts = st.columns(5)
    counts[0].metric("Trials", len(view.trials))
    counts[1].metric("Complete", view.count("complete"))
    counts[2].metric("Infeasible", view.count("infeasible"))
    counts[3].metric("Failed", view.count("failed"))
    counts[4].metric("Running", view.count("running"))
    for t in view.trials:
        if t.status == "running":
            st.info(f"Trial {t.number} is running: {params_text(t.params)}.")
    best = view.best
    if best is None:
        st.info("No feasible trial yet: the best trial appears once one completes within its limits.")
    else:
        st.markdown(f"**Best trial: {best.number}** \u2014 {params_text(best.params)}")
        top = st.columns(3)
        top[0].metric("Best decode tok/s", context.tok_s(best.metrics.get("decode_tok_s")))
        top[1].metric("Its TTFT", context.ms(best.metrics.get("ttft_s")))
        top[2].metric("Pareto front", sum(t.on_front for t in view.trials))
    points = frames.points_frame(view)
    if points.empty:
        st.info("No measured trial yet: the Pareto front of decode tok/s against TTFT appears "
                "after the first one.")
        return
    st.markdown("**Decode tok/s against time to first token** (up and left is better)")
    st.plotly_chart(charts.pareto_figure(points), key="pareto")


def params_text(params: Mapping[str, Any]) -> str:
    if not params:
        return "the engine's defaults (no tuned parameter)"
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in sorted(params.items()))


if __name__ == "__main__":
    render()
