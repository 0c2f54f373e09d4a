"""The trials table: filter by status and draft, sort by any column, with failure reasons."""

from __future__ import annotations

import streamlit as st

from dashboard import context, frames
from dashboard.data import STATUSES


def render() -> None:
    st.title("Trials")
    view = context.study()
    table = frames.trials_frame(view)
    if table.empty:
        st.info(f"Study {view.study.name!r} has no trials yet.")
        return
    present = [s for s in STATUSES if s in set(table["status"])]
    left, middle, right = st.columns([2, 2, 2])
    statuses = left.multiselect("Status", present, default=present, key="trial_status")
    drafts = None
    if "draft" in table:
        options = sorted(table["draft"].dropna().astype(str).unique())
        drafts = middle.multiselect("Draft", options, default=options, key="trial_draft")
    text = right.text_input("Reason contains", key="trial_reason")
    sort_by = left.selectbox("Sort by", list(table.columns), index=0, key="trial_sort")
    descending = middle.toggle("Descending", value=False, key="trial_desc")
    shown = table[table["status"].isin(statuses)]
    if drafts is not None:
        shown = shown[shown["draft"].astype(str).isin(drafts)]
    if text:
        shown = shown[shown["reason"].str.contains(text, case=False, regex=False)]
    shown = shown.sort_values(sort_by, ascending=not descending, na_position="last", kind="stable")
    st.caption(f"{len(shown)} of {len(table)} trials. Constraint values above 0 are violations.")
    st.dataframe(shown, hide_index=True, key="trials_table", column_config={
        "pareto": st.column_config.CheckboxColumn("Pareto"),
        "throttled": st.column_config.CheckboxColumn("throttled"),
        "started": st.column_config.DatetimeColumn("started", format="YYYY-MM-DD HH:mm:ss"),
        "decode_tok_s": st.column_config.NumberColumn(format="%.1f"),
        "ttft_s": st.column_config.NumberColumn(format="%.4f"),
        "duration_s": st.column_config.NumberColumn(format="%.1f"),
    })
    failures = shown[shown["status"].isin(["failed", "infeasible"])]
    if not failures.empty:
        st.subheader("Why trials failed")
        for _, row in failures.iterrows():
            st.markdown(f"- **trial {row['trial']}** ({row['status']}): {row['reason']}")


if __name__ == "__main__":
    render()
