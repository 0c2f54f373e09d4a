"""The appliance config (`appliance.toml`): what to tune, on which models, within which limits.

TOML is parsed here, at the edge: types are checked while reading, ranges in each section's
``__post_init__``, and every error names the file, the key, the value and what is allowed.
Relative paths (models, SQLite database, profile) are relative to the config file.
"""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from engine.errors import EngineError
from engine.profile import SPEC_LOOKUP_MAX  # the committed-text lookup's longest match length

OBJECTIVES = {"decode_tok_s": "maximize", "ttft_s": "minimize", "peak_mem_mb": "minimize"}
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(EngineError):
    """A bad appliance config or command-line setting, said in one sentence."""


def default_config_path() -> Path:
    """The repository's appliance.toml, the embedded default."""
    return Path(__file__).resolve().parent.parent / "appliance.toml"


@dataclass(frozen=True)
class ModelsConfig:
    target: Path
    drafts: tuple[Path, ...] = ()  # DFlash draft candidates
    drafter: Path | None = None  # PFlash drafter

    def __post_init__(self) -> None:
        if len(set(self.drafts)) != len(self.drafts):
            raise ValueError(f"drafts: each candidate must be listed once, found {list(map(str, self.drafts))}")


@dataclass(frozen=True)
class HardwareConfig:
    device: str = "auto"
    dtype: str | None = None  # None: the engine's default for the device
    threads: int | None = None  # None: the engine's default
    vram_cap_mb: int | None = None  # None: the live GPU's total memory
    ram_cap_mb: int | None = None  # None: the live usable RAM (cgroup-aware)
    vram_reserve_mb: int = 1024  # kept off the expert budget: core weights, KV cache, activations

    def __post_init__(self) -> None:
        base = self.device.split(":")[0]
        if base not in DEVICES or (":" in self.device and (base != "cuda" or not self.device.split(":")[1].isdigit())):
            raise ValueError(f"device: expected one of auto, cpu, cuda, cuda:N, found {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, found {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: expected at least 1 or \"auto\", found {self.threads}")
        for name in ("vram_cap_mb", "ram_cap_mb"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}: expected a positive number of MB or \"live\", found {value}")
        if self.vram_reserve_mb < 0:
            raise ValueError(f"vram_reserve_mb: expected 0 or more, found {self.vram_reserve_mb}")

    @property
    def gpu_index(self) -> int:
        return int(self.device.split(":")[1]) if ":" in self.device else 0


ENGINE_FORMATS = ("dense", "quantized")
COLD_DEVICES = ("cpu", "gpu")
PLACEMENT_UNITS = ("expert", "layer", "alternate")  # engine.placement.PLACEMENT_UNITS
PREFETCH_MAX = 4  # engine.hybrid.PREFETCH_MAX: cold experts fetched ahead a layer, at most
WARM_MAX = 8  # engine.kernels.host_experts.WARM_MAX: cold experts warmed ahead a layer, at most


@dataclass(frozen=True)
class EngineConfig:
    """How every trial's engine holds its weights and decodes (``Engine.from_gguf``'s options)."""

    weights: str = "dense"  # projection matrices dequantized at load, or kept as GGUF blocks
    experts: str = "dense"  # routed experts on both tiers dense, or as GGUF blocks (budgets in quantized bytes)
    cuda_graph: bool = True  # decoding, short prefills and DFlash verify blocks replayed from CUDA graphs where possible
    cold_device: str = "cpu"  # what computes the cold experts: CPU threads, or the GPU reading host memory

    def __post_init__(self) -> None:
        for name in ("weights", "experts"):
            if getattr(self, name) not in ENGINE_FORMATS:
                raise ValueError(f"{name}: expected one of {', '.join(ENGINE_FORMATS)}, found {getattr(self, name)!r}")
        if self.cold_device not in COLD_DEVICES:
            raise ValueError(f"cold_device: expected one of {', '.join(COLD_DEVICES)}, found {self.cold_device!r}")

    def load_options(self) -> dict[str, Any]:
        """The ``Engine.from_gguf`` keywords that differ from its defaults."""
        out: dict[str, Any] = {}
        if self.weights != "dense":
            out["weights"] = self.weights
        if self.experts != "dense":
            out["cold_format"] = out["hot_format"] = self.experts
        if not self.cuda_graph:
            out["cuda_graph"] = False
        if self.cold_device != "cpu":
            out["cold_device"] = self.cold_device
        return out


@dataclass(frozen=True)
class SearchConfig:
    expert_budget_step_mb: int = 256
    expert_budget_max_mb: int | None = None  # None: what the live GPU can hold
    spec_len: tuple[int, int] = (2, 8)
    # the committed-text lookup's match lengths to choose from with a draft (0: off); [0] leaves it out of the search
    spec_lookup: tuple[int, ...] = (0,)
    pflash_keep_ratio: tuple[float, float] = (0.05, 0.5)
    pflash: bool = True  # search PFlash when a drafter and long prompts are configured
    pflash_threshold: int | None = None  # compress prompts longer than this; None: engine default
    # share of the cold experts' pairs CPU threads compute beside the bus (cold_device = "gpu" with quantized
    # experts); [0, 0] leaves it out of the search
    cold_cpu_share: tuple[float, float] = (0.0, 0.8)
    # cold experts a layer the bus fetches, and the CPU threads warm, ahead of the router from the predicted
    # routing (with the CPU share's dimension); [0, 0] leaves each out of the search
    cold_prefetch: tuple[int, int] = (0, 0)
    cold_warm: tuple[int, int] = (0, 0)
    # what the hot set grows by at budgets that leave experts cold: single experts by routed mass, whole layers,
    # or both searched
    placement_unit: tuple[str, ...] = ("expert",)

    def __post_init__(self) -> None:
        if self.expert_budget_step_mb < 1:
            raise ValueError(f"expert_budget_step_mb: expected at least 1, found {self.expert_budget_step_mb}")
        if self.expert_budget_max_mb is not None and self.expert_budget_max_mb < 0:
            raise ValueError(f"expert_budget_max_mb: expected 0 or more, found {self.expert_budget_max_mb}")
        lo, hi = self.spec_len
        if not 1 <= lo <= hi:
            raise ValueError(f"spec_len: expected [low, high] with 1 <= low <= high, found [{lo}, {hi}]")
        lookups = self.spec_lookup
        bad = [n for n in lookups if not 0 <= n <= SPEC_LOOKUP_MAX]
        if not lookups or bad or len(set(lookups)) != len(lookups):
            raise ValueError(f"spec_lookup: expected distinct match lengths from 0 (off) to {SPEC_LOOKUP_MAX}, "
                             f"found {bad[0] if bad else list(lookups)}")
        if self.pflash_threshold is not None and self.pflash_threshold < 1:
            raise ValueError(f"pflash_threshold: expected at least 1 token or \"auto\", found {self.pflash_threshold}")
        lo, hi = self.pflash_keep_ratio
        if not 0.0 < lo <= hi <= 1.0:
            raise ValueError(f"pflash_keep_ratio: expected [low, high] with 0 < low <= high <= 1, "
                             f"found [{lo}, {hi}]")
        lo, hi = self.cold_cpu_share
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"cold_cpu_share: expected [low, high] with 0 <= low <= high <= 1, found [{lo}, {hi}]")
        for name, top in (("cold_prefetch", PREFETCH_MAX), ("cold_warm", WARM_MAX)):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi <= top:
                raise ValueError(f"{name}: expected [low, high] with 0 <= low <= high <= {top}, found [{lo}, {hi}]")
        units = self.placement_unit
        if not units or len(set(units)) != len(units) or any(u not in PLACEMENT_UNITS for u in units):
            raise ValueError(f"placement_unit: expected distinct names among {', '.join(PLACEMENT_UNITS)}, "
                             f"found {list(units)}")


@dataclass(frozen=True)
class WorkloadConfig:
    code_prompts: int = 2
    long_form_prompts: int = 1
    niah_cases: int = 1
    long_prompt_tokens: int = 512  # length of the long-form and needle-in-a-haystack prompts
    max_new_tokens: int = 16
    warmup: int = 1
    repeats: int = 3
    seed: int = 0
    corpus: Path | None = None  # held-out text for long prompts; None: the standard library

    def __post_init__(self) -> None:
        for name in ("code_prompts", "long_form_prompts", "niah_cases", "warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected 0 or more, found {getattr(self, name)}")
        for name in ("long_prompt_tokens", "max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected at least 1, found {getattr(self, name)}")
        if self.code_prompts + self.long_form_prompts + self.niah_cases == 0:
            raise ValueError("code_prompts: at least one prompt set must have prompts, found none")
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens: expected at least 2 to time decoding, found {self.max_new_tokens}")

    @property
    def has_long_prompts(self) -> bool:
        return self.long_form_prompts + self.niah_cases > 0


@dataclass(frozen=True)
class ObjectivesConfig:
    metrics: tuple[str, ...] = ("decode_tok_s", "ttft_s")  # the first picks the published winner

    def __post_init__(self) -> None:
        if not self.metrics or len(set(self.metrics)) != len(self.metrics):
            raise ValueError(f"metrics: expected distinct names, found {list(self.metrics)}")
        for m in self.metrics:
            if m not in OBJECTIVES:
                raise ValueError(f"metrics: {m!r} is not one of {', '.join(OBJECTIVES)}")

    @property
    def directions(self) -> tuple[str, ...]:
        return tuple(OBJECTIVES[m] for m in self.metrics)


@dataclass(frozen=True)
class ConstraintsConfig:
    greedy_identical: bool = True  # speculative greedy output must equal plain decoding
    niah_min_accuracy: float = 1.0  # PFlash retrieval accuracy floor
    # a first difference where plain decoding's two best logits were within this many rounding
    # steps (ulps of the model dtype) is a numerical tie, counted apart, not a mismatch
    greedy_tie_ulps: float = 1.0

    def __post_init__(self) -> None:
        if self.greedy_tie_ulps < 0:
            raise ValueError(f"greedy_tie_ulps: expected 0 or more, found {self.greedy_tie_ulps}")
        if not 0.0 <= self.niah_min_accuracy <= 1.0:
            raise ValueError(f"niah_min_accuracy: expected a fraction in [0, 1], found {self.niah_min_accuracy}")


@dataclass(frozen=True)
class StudyConfig:
    storage: str = "sqlite:///runs/luce-tune.db"
    name: str = "luce-tune"
    trials: int | None = 8  # finished trials the study should hold; None: until timeout_s
    timeout_s: float | None = None  # wall-clock limit of one `luce-tune run`
    trial_timeout_s: float = 120.0  # one measurement, engine load excluded
    load_timeout_s: float = 600.0  # one engine load
    seed: int = 0
    heartbeat_s: int = 5  # a running trial silent for 3 heartbeats belongs to a dead run
    throttle_retries: int = 2
    remeasure_repeats: int = 5

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError(f"name: expected a non-empty study name, found {self.name!r}")
        if self.trials is None and self.timeout_s is None:
            raise ValueError("trials: give a trial count, a timeout_s, or both; found neither")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"trials: expected at least 1, found {self.trials}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, found {self.timeout_s}")
        for name in ("trial_timeout_s", "load_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number of seconds, found {getattr(self, name)}")
        if self.heartbeat_s < 1:
            raise ValueError(f"heartbeat_s: expected at least 1, found {self.heartbeat_s}")
        if self.throttle_retries < 0:
            raise ValueError(f"throttle_retries: expected 0 or more, found {self.throttle_retries}")
        if self.remeasure_repeats < 1:
            raise ValueError(f"remeasure_repeats: expected at least 1, found {self.remeasure_repeats}")


@dataclass(frozen=True)
class PublishConfig:
    profile: Path


@dataclass(frozen=True)
class ApplianceConfig:
    source: Path
    models: ModelsConfig
    hardware: HardwareConfig
    engine: EngineConfig
    search: SearchConfig
    workload: WorkloadConfig
    objectives: ObjectivesConfig
    constraints: ConstraintsConfig
    study: StudyConfig
    publish: PublishConfig

    def __post_init__(self) -> None:
        pflash = self.search.pflash and self.models.drafter is not None
        if pflash and self.constraints.niah_min_accuracy > 0 and self.workload.niah_cases == 0:
            raise ConfigError(
                f"{self.source}: constraints.niah_min_accuracy {self.constraints.niah_min_accuracy} "
                "needs workload.niah_cases of at least 1 to score PFlash retrieval, found 0")

    def with_study(self, **changes: Any) -> "ApplianceConfig":
        """A copy with study settings overridden (from the command line), validated again."""
        try:
            return replace(self, study=replace(self.study, **changes))
        except ValueError as exc:
            raise ConfigError(f"command line: {exc}") from None


def load_config(path: str | Path | None = None) -> ApplianceConfig:
    """Read and validate an appliance config; None reads the embedded default."""
    path = Path(path) if path is not None else default_config_path()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: appliance config not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the appliance config: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(raw, path)


def parse_config(raw: dict[str, Any], path: Path) -> ApplianceConfig:
    base = path.resolve().parent
    unknown = set(raw) - set(_SECTIONS)
    if unknown:
        raise ConfigError(f"{path}: unknown section [{sorted(unknown)[0]}]; "
                          f"allowed: {', '.join(_SECTIONS)}")
    for required in ("models", "study", "publish"):
        if required not in raw:
            raise ConfigError(f"{path}: section [{required}] is missing")
    sections = {name: _section(path, base, name, raw[name]) for name in _SECTIONS if name in raw}
    return ApplianceConfig(source=path, **{
        name: sections.get(name) or _SECTIONS[name][0]() for name in _SECTIONS})


def _section(path: Path, base: Path, name: str, raw: Any) -> Any:
    cls, readers = _SECTIONS[name]
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: [{name}] must be a table, found {raw!r}")
    unknown = set(raw) - set(readers)
    if unknown:
        raise ConfigError(f"{path}: {name}.{sorted(unknown)[0]} is not a known key; "
                          f"allowed: {', '.join(readers)}")
    values = {}
    if name == "study":  # the default SQLite file lives beside the config, like the others
        values["storage"] = _storage_url(StudyConfig.storage, base)
    for key, value in raw.items():
        try:
            values[key] = readers[key](value, base)
        except _TypeMismatch as exc:
            raise ConfigError(f"{path}: {name}.{key}: expected {exc}, found {value!r}") from None
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [k for k in required if k not in values]
    if missing:
        raise ConfigError(f"{path}: {name}.{missing[0]} is missing")
    try:
        return cls(**values)
    except ValueError as exc:
        raise ConfigError(f"{path}: {name}.{exc}") from None


class _TypeMismatch(Exception):
    pass


Reader = Callable[[Any, Path], Any]


def _int(value: Any, _base: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _TypeMismatch("an integer")
    return value


def _float(value: Any, _base: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _TypeMismatch("a number")
    return float(value)


def _bool(value: Any, _base: Path) -> bool:
    if not isinstance(value, bool):
        raise _TypeMismatch("true or false")
    return value


def _str(value: Any, _base: Path) -> str:
    if not isinstance(value, str):
        raise _TypeMismatch("a string")
    return value


def _path(value: Any, base: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise _TypeMismatch("a file path")
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def _paths(value: Any, base: Path) -> tuple[Path, ...]:
    if not isinstance(value, list):
        raise _TypeMismatch("a list of file paths")
    return tuple(_path(v, base) for v in value)


def _optional_path(value: Any, base: Path) -> Path | None:
    return None if value == "" else _path(value, base)


def _live_mb(value: Any, _base: Path) -> int | None:
    if value == "live":
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _TypeMismatch('"live" or a whole number of MB')
    return value


def _auto_int(value: Any, _base: Path) -> int | None:
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _TypeMismatch('"auto" or an integer')
    return value


def _auto_str(value: Any, _base: Path) -> str | None:
    if value == "auto":
        return None
    return _str(value, _base)


def _optional_seconds(value: Any, _base: Path) -> float | None:
    if value == "none":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _TypeMismatch('a number of seconds or "none"')
    return float(value)


def _optional_count(value: Any, _base: Path) -> int | None:
    if value == "none":
        return None
    return _int(value, _base)


def _int_pair(value: Any, _base: Path) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in value)):
        raise _TypeMismatch("[low, high], two integers")
    return (value[0], value[1])


def _ints(value: Any, _base: Path) -> tuple[int, ...]:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise _TypeMismatch("a list of integers")
    return tuple(value)


def _float_pair(value: Any, _base: Path) -> tuple[float, float]:
    if (not isinstance(value, list) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value)):
        raise _TypeMismatch("[low, high], two numbers")
    return (float(value[0]), float(value[1]))


def _names(value: Any, _base: Path) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _TypeMismatch("a list of names")
    return tuple(value)


def _storage_url(value: Any, base: Path) -> str:
    """A database URL; a relative SQLite path is made relative to the config file."""
    url = _str(value, base)
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/") and len(url) > len(prefix):
        return prefix + str(base / url[len(prefix):])
    return url


_SECTIONS: dict[str, tuple[type, dict[str, Reader]]] = {
    "models": (ModelsConfig, {"target": _path, "drafts": _paths, "drafter": _optional_path}),
    "hardware": (HardwareConfig, {
        "device": _str, "dtype": _auto_str, "threads": _auto_int, "vram_cap_mb": _live_mb,
        "ram_cap_mb": _live_mb, "vram_reserve_mb": _int}),
    "engine": (EngineConfig, {"weights": _str, "experts": _str, "cuda_graph": _bool, "cold_device": _str}),
    "search": (SearchConfig, {
        "expert_budget_step_mb": _int, "expert_budget_max_mb": _live_mb, "spec_len": _int_pair,
        "spec_lookup": _ints, "pflash_keep_ratio": _float_pair, "pflash": _bool, "pflash_threshold": _auto_int,
        "cold_cpu_share": _float_pair, "cold_prefetch": _int_pair, "cold_warm": _int_pair,
        "placement_unit": _names}),
    "workload": (WorkloadConfig, {
        "code_prompts": _int, "long_form_prompts": _int, "niah_cases": _int,
        "long_prompt_tokens": _int, "max_new_tokens": _int, "warmup": _int, "repeats": _int,
        "seed": _int, "corpus": _optional_path}),
    "objectives": (ObjectivesConfig, {"metrics": _names}),
    "constraints": (ConstraintsConfig, {"greedy_identical": _bool, "niah_min_accuracy": _float,
                                        "greedy_tie_ulps": _float}),
    "study": (StudyConfig, {
        "storage": _storage_url, "name": _str, "trials": _optional_count,
        "timeout_s": _optional_seconds, "trial_timeout_s": _float, "load_timeout_s": _float,
        "seed": _int, "heartbeat_s": _int, "throttle_retries": _int, "remeasure_repeats": _int}),
    "publish": (PublishConfig, {"profile": _path}),
}
