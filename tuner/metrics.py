"""From a worker's outputs to a trial's objectives and constraints."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from tuner.protocol import Output

_BASIC_TIMINGS = {"prompt_tokens", "new_tokens", "prefill_s", "decode_s", "decode_tok_s", "peak_mem_mb"}


@dataclass(frozen=True)
class Stat:
    """Median of the repeats with their range: the spread a profile publishes."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Stat":
        if not values:
            raise ValueError("a statistic needs at least one value")
        return cls(median=float(statistics.median(values)), low=float(min(values)),
                   high=float(max(values)), n=len(values))

    @property
    def spread(self) -> float:
        return self.high - self.low


@dataclass(frozen=True)
class TrialMetrics:
    decode_tok_s: Stat  # per repeat: decoded tokens / decode seconds over all prompts
    ttft_s: Stat  # per repeat: mean time to first token over all prompts
    peak_mem_mb: float  # the engine's peak (GPU allocator on CUDA, process RSS on the CPU)
    extras: Mapping[str, float] = field(default_factory=dict)  # means of optional timings
    greedy_mismatches: int | None = None  # prompts whose greedy ids differ from the baseline
    greedy_ties: int | None = None  # prompts that first differ at a numerical tie of the baseline
    niah_accuracy: float | None = None

    def objective(self, name: str) -> float:
        if name == "peak_mem_mb":
            return self.peak_mem_mb
        return getattr(self, name).median

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def aggregate(outputs: Sequence[Output], *, baseline: Mapping[str, Sequence[int]] | None = None,
              baseline_margins: Mapping[str, Sequence[float]] | None = None, tie_ulps: float = 0.0,
              score: Callable[[str, str], float] | None = None,
              niah_keys: Sequence[str] = ()) -> TrialMetrics:
    """Medians over repeats; the greedy check against ``baseline`` (prompt key -> ids, for the
    prompts it holds) and the retrieval score ``score(key, text)`` of the ``niah_keys``.

    A prompt whose ids first differ from the baseline's where the baseline's top-2 logit gap
    (``baseline_margins``, in ulps) was at most ``tie_ulps`` is a tie, not a mismatch: the
    two decodings rounded a tie differently, and nothing after it can be compared."""
    repeats = sorted({o.repeat for o in outputs})
    if not repeats:
        raise ValueError("no outputs to aggregate")
    tok_s, ttft = [], []
    for r in repeats:
        runs = [o for o in outputs if o.repeat == r]
        tokens = sum(max(int(o.timings["new_tokens"]) - 1, 0) for o in runs)
        seconds = sum(_decode_seconds(o.timings) for o in runs)
        tok_s.append(tokens / seconds if seconds > 0 else 0.0)
        ttft.append(statistics.fmean(float(o.timings["prefill_s"]) for o in runs))
    extras: dict[str, float] = {}
    for key in sorted({k for o in outputs for k in o.timings} - _BASIC_TIMINGS):
        values = [o.timings[key] for o in outputs if isinstance(o.timings.get(key), (int, float))
                  and not isinstance(o.timings.get(key), bool)]
        if values:
            extras[key] = float(statistics.fmean(values))
    mismatches = ties = None
    if baseline is not None:
        gaps: dict[str, list[float]] = {}  # per differing prompt, the gap at each repeat's departure
        for o in outputs:
            if o.key in baseline and tuple(o.ids) != tuple(baseline[o.key]):
                gaps.setdefault(o.key, []).append(
                    _first_gap(o.ids, baseline[o.key], (baseline_margins or {}).get(o.key, ())))
        tied = {k for k, g in gaps.items() if max(g) <= tie_ulps}
        mismatches, ties = len(gaps) - len(tied), len(tied)
    accuracy = None
    if score is not None and niah_keys:
        scored = [score(o.key, o.text) for o in outputs if o.key in niah_keys]
        accuracy = float(statistics.fmean(scored)) if scored else None
    return TrialMetrics(
        decode_tok_s=Stat.of(tok_s), ttft_s=Stat.of(ttft),
        peak_mem_mb=max(float(o.timings.get("peak_mem_mb", 0.0)) for o in outputs),
        extras=extras, greedy_mismatches=mismatches, greedy_ties=ties, niah_accuracy=accuracy)


def _first_gap(ids: Sequence[int], reference: Sequence[int], margins: Sequence[float]) -> float:
    """The reference's top-2 gap where ``ids`` first departs from it (infinite when unknown)."""
    i = next((j for j, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))
    return float(margins[i]) if i < len(margins) else math.inf


def _decode_seconds(t: Mapping[str, Any]) -> float:
    if "decode_s" in t:
        return float(t["decode_s"])
    n = int(t["new_tokens"]) - 1
    rate = float(t["decode_tok_s"])
    return n / rate if n > 0 and rate > 0 else 0.0


def constraints(m: TrialMetrics, *, vram_cap_mb: float | None, vram_peak_mb: float | None,
                ram_cap_mb: float, rss_peak_mb: float | None, uses_draft: bool,
                greedy_identical: bool, uses_pflash: bool,
                niah_min_accuracy: float) -> dict[str, float]:
    """Optuna constraint values: a trial is feasible when every value is <= 0."""
    out: dict[str, float] = {}
    if vram_cap_mb is not None:
        out["vram_over_cap_mb"] = (vram_peak_mb or 0.0) - vram_cap_mb
    out["ram_over_cap_mb"] = (rss_peak_mb if rss_peak_mb is not None else m.peak_mem_mb) - ram_cap_mb
    out["greedy_mismatches"] = float(m.greedy_mismatches or 0) if uses_draft and greedy_identical else 0.0
    if uses_pflash:
        out["niah_below_floor"] = niah_min_accuracy - (m.niah_accuracy or 0.0)
    else:
        out["niah_below_floor"] = 0.0
    return out
