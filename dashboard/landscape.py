"""The search landscape: expert budget x spec_len x keep ratio against the objectives."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, context, frames

OBJECTIVES = {"decode_tok_s": "max", "ttft_s": "min"}  # metric -> which value is best


def render() -> None:
    st.title("Landscape")
    view = context.study()
    df, dims = frames.landscape_frame(view)
    if df.empty:
        st.info(f"Study {view.study.name!r} has no measured trial yet.")
        return
    if not dims:
        st.info("This study searched no numeric knob (no GPU expert budget, no draft, no PFlash "
                "on this machine): there is no landscape to draw.")
        return
    z = st.radio("Colour by", list(OBJECTIVES), horizontal=True, key="landscape_metric")
    st.caption("spec_len 0 is plain decoding, spec_lookup 0 is the lookup off and keep ratio 1.0 is PFlash off. "
               f"{len(df)} measured trials.")
    if len(dims) == 1:
        st.plotly_chart(charts.scatter_figure(df, dims[0], z), key="landscape_scatter")
        return
    left, right = st.columns(2)
    x = left.selectbox("Heatmap x", dims, index=0, key="landscape_x")
    y = right.selectbox("Heatmap y", [d for d in dims if d != x], index=0, key="landscape_y")
    st.markdown(f"**{OBJECTIVES[z]} {z} per cell**")
    st.plotly_chart(charts.heatmap_figure(df, x, y, z, best=OBJECTIVES[z]), key="landscape_heatmap")
    st.markdown("**Every trial across all knobs**")
    st.plotly_chart(charts.parallel_figure(df, dims, z), key="landscape_parallel")


if __name__ == "__main__":
    render()
