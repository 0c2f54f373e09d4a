"""The published profile of the study, its provenance, and how it compares with the current best."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from dashboard import context, frames
from dashboard.data import StudyView
from storage.records import ProfileRecord

KNOBS = ("expert_budget_mb", "draft", "spec_len", "spec_lookup", "pflash_keep_ratio", "cold_cpu_share",
         "placement_unit", "cold_prefetch", "cold_warm")


def render() -> None:
    st.title("Published profile")
    view = context.study()
    src = context.source()
    published = src.profiles(view.study.name)
    if not published:
        st.info(f"Nothing has been published for study {view.study.name!r} yet: the tuner writes "
                "a profile when a run ends with a feasible trial.")
        return
    record = published[-1]
    try:
        content = tomllib.loads(record.content)
    except tomllib.TOMLDecodeError as exc:
        st.error(f"The stored profile {record.path} is not valid TOML: {exc}.")
        return
    head = content.get("profile", {})
    st.subheader(f"Trial {record.trial_number}, published {_when(record)}")
    _provenance(record, head, content, src.hardware())
    _compare(record, content, view)
    st.markdown("**The profile as written**")
    st.code(record.content, language="toml")
    if len(published) > 1:
        with st.expander(f"Earlier profiles of this study ({len(published) - 1})"):
            st.dataframe(pd.DataFrame([{"trial": p.trial_number, "path": p.path, "created": p.created,
                                        "sha256": p.sha256[:12]} for p in published[:-1]]),
                         hide_index=True)


def _when(record: ProfileRecord) -> str:
    return record.created.strftime("%Y-%m-%d %H:%M:%S UTC") if record.created else "at an unknown time"


def _provenance(record: ProfileRecord, head: dict, content: dict, machines: dict) -> None:
    machine = frames.hardware_label(machines.get(record.hardware_id))
    on_disk = _file_state(record)
    rows = [("study", head.get("study", record.study)), ("trial", record.trial_number),
            ("created", head.get("created", "")), ("luce-tune", head.get("luce_tune_version", "")),
            ("measured on", machine), ("written to", record.path),
            ("sha256", record.sha256), ("file now", on_disk)]
    for role, model in content.get("models", {}).items():
        rows.append((f"model {role}", f"{model.get('path')} ({model.get('size', 0):,} bytes, "
                                      f"sha256 {str(model.get('sha256', ''))[:12]}...)"))
    st.markdown("**Provenance**")
    st.table(pd.DataFrame(rows, columns=["", "value"]).astype(str).set_index(""))


def _file_state(record: ProfileRecord) -> str:
    path = Path(record.path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if hashlib.sha256(data).hexdigest() == record.sha256:
        return "matches what was published"
    return "differs from what was published (edited or published again since)"


def _compare(record: ProfileRecord, content: dict, view: StudyView) -> None:
    st.markdown("**Published profile against the current best trial**")
    best = view.best
    if best is None:
        st.info("The study has no feasible trial to compare with.")
        return
    engine = content.get("engine", {})
    metrics = content.get("metrics", {})
    draft = content.get("models", {}).get("draft", {}).get("path")
    published = {"trial": record.trial_number, **{k: engine.get(k) for k in KNOBS},
                 "draft": Path(draft).name if draft else "none",
                 "decode tok/s": metrics.get("decode_tok_s", {}).get("median"),
                 "TTFT s": metrics.get("ttft_s", {}).get("median")}
    current = {"trial": best.number, **{k: best.params.get(k) for k in KNOBS},
               "draft": best.params.get("draft", "none"),
               "decode tok/s": best.metrics.get("decode_tok_s"), "TTFT s": best.metrics.get("ttft_s")}
    rows = [(key, _show(key, published[key]), _show(key, current[key])) for key in published]
    st.table(pd.DataFrame(rows, columns=["", "published", "current best"]).set_index(""))
    cols = st.columns(2)
    cols[0].metric("Published decode tok/s", context.tok_s(published["decode tok/s"]),
                   help="median of the re-measurement before publishing")
    delta = None
    if published["decode tok/s"] is not None and current["decode tok/s"] is not None:
        delta = f"{current['decode tok/s'] - published['decode tok/s']:+.1f}"
    cols[1].metric("Current best decode tok/s", context.tok_s(current["decode tok/s"]), delta=delta,
                   help="median of the trial's own measurement")
    mine = view.trial(record.trial_number)
    goal = view.objectives[0]
    if mine is None or best.number == mine.number:
        return
    ahead = best.metrics.get(goal) != mine.metrics.get(goal)
    if ahead:
        st.warning(f"Trial {best.number} now beats the published trial {mine.number} on {goal}: "
                   "the profile is older than the study's results.")
    else:
        st.caption(f"Trial {best.number} ties with the published trial {mine.number} on {goal}; "
                   "the re-measurement before publishing chose between them.")


def _show(key: str, value: Any) -> str:
    if value is None:
        return "\u2014"
    if key == "decode tok/s":
        return context.tok_s(value)
    if key == "TTFT s":
        return context.ms(value)
    return f"{value:.3g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    render()
