"""Studies compared across the machines (hardware fingerprints) that measured them."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, context, frames
from dashboard.data import READ_ERRORS, describe_error


def render() -> None:
    st.title("Hardware comparison")
    src = context.source()
    try:
        table = frames.comparison_frame(src.comparisons())
    except READ_ERRORS as exc:
        st.error(f"Cannot read the study database: {describe_error(exc, src.display_url)}.")
        return
    if table.empty:
        st.info("No trial has been measured yet on any machine.")
        return
    machines = table["machine"].nunique()
    st.caption(f"{table['study'].nunique()} studies measured on {machines} "
               f"machine{'s' if machines != 1 else ''} (best of each study's trials per machine).")
    st.dataframe(table, hide_index=True, key="hardware_table", column_config={
        "best decode tok/s": st.column_config.NumberColumn(format="%.1f"),
        "best TTFT ms": st.column_config.NumberColumn(format="%.1f"),
    })
    if table["best decode tok/s"].notna().any():
        st.plotly_chart(charts.comparison_figure(table.dropna(subset=["best decode tok/s"])),
                        key="hardware_chart")


if __name__ == "__main__":
    render()
