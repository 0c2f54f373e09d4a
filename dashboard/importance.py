"""Parameter importance per objective (Optuna's default, PED-ANOVA), or why it cannot be computed yet."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, context
from dashboard.data import READ_ERRORS, describe_error


def render() -> None:
    st.title("Parameter importance")
    view = context.study()
    src = context.source()
    for i, name in enumerate(view.objectives):
        st.subheader(name)
        try:
            ranked, why = src.importance(view.study.name, i)
        except READ_ERRORS as exc:
            st.error(f"Cannot read study {view.study.name!r}: {describe_error(exc, src.display_url)}.")
            return
        if ranked is None:
            st.info(why)
            continue
        st.plotly_chart(charts.importance_figure(ranked), key=f"importance_{i}")
        st.caption("Most important: " + ", ".join(f"{k} {v:.2f}" for k, v in ranked.items()))


if __name__ == "__main__":
    render()
