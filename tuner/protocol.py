"""Messages between the tuner and its engine worker process (pickled through a pipe)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoadSpec:
    """What needs an engine (re)load to change; everything else is set in place."""

    target: str
    draft: str | None = None
    drafter: str | None = None
    pflash_threshold: int | None = None  # with a drafter: compress prompts longer than this
    device: str = "auto"
    dtype: str | None = None
    threads: int | None = None
    options: tuple[tuple[str, Any], ...] = ()  # further Engine.from_gguf keywords ([engine] of the config)


@dataclass(frozen=True)
class Job:
    """One prompt of a workload. ``long`` prompts are the ones PFlash may compress."""

    key: str
    prompt: str
    max_new_tokens: int
    long: bool = False


@dataclass(frozen=True)
class Load:
    spec: LoadSpec
    expert_budget_mb: int | None = None


@dataclass(frozen=True)
class Measure:
    """Configure the engine, warm up, then run every job ``repeats`` times, greedily."""

    spec: LoadSpec
    jobs: tuple[Job, ...]
    expert_budget_mb: int | None = None
    spec_len: int | None = None
    spec_lookup: int | None = None  # with spec_len: the committed-text lookup's match length; None: the engine's (off)
    pflash_keep_ratio: float | None = None
    cold_cpu_share: float | None = None  # set before measuring (Engine.set_cold_cpu_share); None: leave at 0
    placement_unit: str | None = None  # what the budget's hot set grows by (Engine.set_expert_budget); None: expert
    cold_prefetch: int | None = None  # cold experts fetched ahead a layer (Engine.set_cold_prefetch); None: 0
    cold_warm: int | None = None  # cold experts the CPU threads warm ahead a layer; None: 0
    warmup: int = 1
    repeats: int = 1
    seed: int = 0
    margins: bool = False  # also report each greedy token's top-2 logit gap (Engine.greedy_margins)
    hang_s: float = 0.0  # test hook: sleep this long before measuring, to exercise the timeout


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Loading:
    """Sent by the worker before a (re)load: the tuner switches to the load timeout."""


@dataclass(frozen=True)
class Loaded:
    load_s: float
    device: str


@dataclass(frozen=True)
class Output:
    key: str
    repeat: int
    ids: tuple[int, ...]
    text: str
    timings: dict[str, Any]
    margins: tuple[float, ...] = ()  # with Measure.margins: top-2 logit gap per new token, in ulps


@dataclass(frozen=True)
class Measured:
    outputs: tuple[Output, ...]
    device: str


@dataclass(frozen=True)
class Failure:
    """The worker survived an error. ``kind``: "user" (an EngineError), "oom" or "error"."""

    kind: str
    message: str
