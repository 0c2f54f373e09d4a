"""Tables the pages show, as pandas DataFrames built from the data layer's views."""

from __future__ import annotations

from dataclasses import asdict
from typing import Sequence

import pandas as pd

from dashboard.data import Comparison, StudyView, TrialView
from storage.records import HardwareRecord, MeasurementRecord, TelemetrySample

NO_DRAFT = "none"  # the tuner's name for plain decoding in the draft dimension
# Numeric knobs of the landscape and what a trial without the knob means on that axis.
LANDSCAPE_DIMS = {"expert_budget_mb": None, "spec_len": 0, "spec_lookup": 0, "pflash_keep_ratio": 1.0,
                  "cold_cpu_share": 0.0, "cold_prefetch": 0, "cold_warm": 0}


def draft_label(params: dict) -> str:
    return str(params.get("draft", NO_DRAFT))


def pflash_label(params: dict) -> str:
    keep = params.get("pflash_keep_ratio")
    return "PFlash on" if params.get("pflash") == "on" and keep is not None else "PFlash off"


def hardware_label(h: HardwareRecord | None) -> str:
    if h is None:
        return "unknown machine"
    cpu = f"{h.cpu} x{h.cpu_count}, {h.ram_mb / 1024:.0f} GiB RAM"
    if h.gpu_name:
        return f"{h.gpu_name} ({h.gpu_vram_mb / 1024:.0f} GiB), {cpu}"
    return f"CPU only: {cpu}"


def trials_frame(view: StudyView) -> pd.DataFrame:
    """One row per trial: status, parameters, metrics, constraints and failure reason."""
    params = sorted({k for t in view.trials for k in t.params})
    metric_names = list(dict.fromkeys([*view.objectives, "decode_tok_s", "ttft_s"]))
    constraints = sorted({k for t in view.trials for k in t.record.constraints})
    rows = []
    for t in view.trials:
        r = t.record
        row: dict = {"trial": t.number, "status": t.status, "pareto": t.on_front}
        row |= {p: r.params.get(p) for p in params}
        row |= {m: t.metrics.get(m) for m in metric_names}
        row |= {f"constraint {c}": r.constraints.get(c) for c in constraints}
        row |= {"reason": t.reason, "duration_s": r.duration_s, "started": r.started,
                "device": r.user_attrs.get("device", ""), "throttled": bool(r.user_attrs.get("throttled")),
                "hardware": str(r.user_attrs.get("hardware", ""))[:12]}
        rows.append(row)
    columns = ["trial", "status", "pareto", *params, *metric_names,
               *(f"constraint {c}" for c in constraints),
               "reason", "duration_s", "started", "device", "throttled", "hardware"]
    return pd.DataFrame(rows, columns=columns)


def measured(view: StudyView) -> list[TrialView]:
    """Trials with measured metrics (feasible or not), for charts."""
    return [t for t in view.trials if t.status in ("complete", "infeasible")
            and t.metrics.get("decode_tok_s") is not None and t.metrics.get("ttft_s") is not None]


def points_frame(view: StudyView) -> pd.DataFrame:
    """The measured trials as points: metrics, draft and PFlash labels, front membership."""
    rows = [{"trial": t.number, "decode_tok_s": t.metrics["decode_tok_s"], "ttft_s": t.metrics["ttft_s"],
             "draft": draft_label(dict(t.params)), "pflash": pflash_label(dict(t.params)),
             "feasible": t.status == "complete", "pareto": t.on_front}
            for t in measured(view)]
    return pd.DataFrame(rows, columns=["trial", "decode_tok_s", "ttft_s", "draft", "pflash",
                                       "feasible", "pareto"])


def landscape_frame(view: StudyView) -> tuple[pd.DataFrame, list[str]]:
    """Measured trials over the numeric knobs the study searched, and those knobs' names.

    A trial without a conditional knob sits where that knob is off: spec_len 0 for plain
    decoding, spec_lookup 0 without the committed-text lookup, keep ratio 1.0 when the whole prompt is
    prefilled.
    """
    trials = measured(view)
    dims = [d for d in LANDSCAPE_DIMS if any(d in t.params for t in trials)]
    rows = []
    for t in trials:
        row = {"trial": t.number, "decode_tok_s": t.metrics["decode_tok_s"],
               "ttft_s": t.metrics["ttft_s"], "draft": draft_label(dict(t.params)),
               "feasible": t.status == "complete"}
        for d in dims:
            value = t.params.get(d, LANDSCAPE_DIMS[d])
            row[d] = float(value) if value is not None else None
        rows.append(row)
    return pd.DataFrame(rows, columns=["trial", *dims, "decode_tok_s", "ttft_s", "draft",
                                       "feasible"]), dims


def measurements_frame(measurements: Sequence[MeasurementRecord]) -> pd.DataFrame:
    rows = [{"id": m.id, "trial": m.trial_number, "phase": m.phase, "attempt": m.attempt,
             "status": m.status, "decode_tok_s": m.decode_tok_s, "ttft_s": m.ttft_s,
             "peak_mem_mb": m.peak_mem_mb, "throttled": m.throttled, "reason": m.reason}
            for m in measurements]
    return pd.DataFrame(rows, columns=["id", "trial", "phase", "attempt", "status", "decode_tok_s",
                                       "ttft_s", "peak_mem_mb", "throttled", "reason"])


def samples_frame(samples: Sequence[TelemetrySample]) -> pd.DataFrame:
    columns = list(TelemetrySample.__dataclass_fields__)
    return pd.DataFrame([asdict(s) for s in samples], columns=columns)


def comparison_frame(comparisons: Sequence[Comparison]) -> pd.DataFrame:
    rows = [{"study": c.study, "machine": hardware_label(c.hardware),
             "gpu": c.hardware.gpu_name if c.hardware else "", "trials": c.trials,
             "feasible": c.feasible, "best decode tok/s": c.best_decode_tok_s,
             "best TTFT ms": c.best_ttft_s * 1e3 if c.best_ttft_s is not None else None,
             "fingerprint": c.hardware.key[:12] if c.hardware else ""}
            for c in comparisons]
    return pd.DataFrame(rows, columns=["study", "machine", "gpu", "trials", "feasible",
                                       "best decode tok/s", "best TTFT ms", "fingerprint"])
