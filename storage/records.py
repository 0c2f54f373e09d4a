"""Plain, frozen records that storage hands out and accepts: never live ORM rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping


@dataclass(frozen=True)
class HardwareRecord:
    """A machine as the tuner saw it; ``key`` identifies the fingerprint."""

    key: str
    gpu_name: str
    gpu_uuid: str
    gpu_driver: str
    gpu_vram_mb: int
    cpu: str
    cpu_count: int
    ram_mb: int
    id: int | None = None
    first_seen: datetime | None = None


@dataclass(frozen=True)
class TelemetrySample:
    """One telemetry reading; GPU fields are None without NVML, cgroup fields without cgroup v2."""

    t_s: float  # seconds since the measurement started
    cpu_pct: float
    rss_mb: float  # resident memory of the engine worker
    ram_available_mb: float
    cgroup_mem_mb: float | None = None
    gpu_mem_mb: float | None = None
    gpu_power_w: float | None = None
    gpu_energy_j: float | None = None  # the board's counter since driver load
    gpu_temp_c: float | None = None
    gpu_sm_clock_mhz: float | None = None
    gpu_util_pct: float | None = None
    gpu_clock_reasons: int | None = None  # NVML clocks-event reason bits


@dataclass(frozen=True)
class MeasurementRecord:
    """One measurement of one trial's settings.

    ``phase`` is "trial" for the measurement Optuna was told about and "remeasure" for the
    re-measurement of finalists before publishing; a throttled measurement is repeated, each
    attempt is kept. ``status`` is "complete", "failed" or "infeasible".
    """

    study: str
    trial_number: int
    phase: str
    attempt: int
    status: str
    reason: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)
    decode_tok_s: float | None = None
    ttft_s: float | None = None
    peak_mem_mb: float | None = None
    throttled: bool = False
    metrics: Mapping[str, Any] = field(default_factory=dict)  # medians, spreads, engine extras
    telemetry: Mapping[str, Any] = field(default_factory=dict)  # the samples' summary
    hardware_id: int | None = None
    id: int | None = None
    created: datetime | None = None


@dataclass(frozen=True)
class ProfileRecord:
    """A published profile: where it was written and exactly what it said."""

    study: str
    trial_number: int
    path: str
    sha256: str
    content: str
    hardware_id: int | None = None
    id: int | None = None
    created: datetime | None = None


@dataclass(frozen=True)
class TrialRecord:
    """An Optuna trial, flattened. ``values`` is None unless the trial completed."""

    study: str
    number: int
    state: str  # "COMPLETE", "FAIL", "RUNNING", "WAITING", "PRUNED"
    params: Mapping[str, Any]
    values: tuple[float, ...] | None
    constraints: Mapping[str, float]
    user_attrs: Mapping[str, Any]
    started: datetime | None
    finished: datetime | None

    @property
    def feasible(self) -> bool:
        return self.state == "COMPLETE" and all(v <= 0.0 for v in self.constraints.values())

    @property
    def duration_s(self) -> float | None:
        if self.started is None or self.finished is None:
            return None
        return (self.finished - self.started).total_seconds()


@dataclass(frozen=True)
class StudyRecord:
    name: str
    directions: tuple[str, ...]  # "MAXIMIZE" / "MINIMIZE", one per objective
    objective_names: tuple[str, ...]
    n_trials: int
    user_attrs: Mapping[str, Any]
