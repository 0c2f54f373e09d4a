"""Which routed experts live on the GPU: routing statistics, the knapsack that picks the hot
set for a VRAM budget, and the check that a budget fits on the live GPU.

Budgets are in MB of 2**20 bytes of expert weights as stored on the GPU. Routing statistics
sit beside the model as ``<model>.routing.json``, tied to the model file by its size and the
sha256 of its first bytes; stale or missing statistics fall back to uniform routing.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from engine.errors import ConfigError, EngineError
from engine.model.config import ModelConfig

MB = 2**20
STATS_FORMAT = "luce-tune routing statistics"
STATS_VERSION = 1
FINGERPRINT_PREFIX_BYTES = 16 * MB


class RoutingStatsError(EngineError):
    """A routing statistics file that cannot be read."""


class StaleRoutingStats(UserWarning):
    """Routing statistics recorded for another model file; they are ignored."""


@dataclass(frozen=True)
class ModelFingerprint:
    """Identifies a model file cheaply: its size and the sha256 of its first ``prefix_bytes``."""

    size: int
    sha256_prefix: str
    prefix_bytes: int

    @classmethod
    def of(cls, path: str | Path, prefix_bytes: int = FINGERPRINT_PREFIX_BYTES) -> "ModelFingerprint":
        path = Path(path)
        with path.open("rb") as f:
            digest = hashlib.sha256(f.read(prefix_bytes)).hexdigest()
        return cls(size=path.stat().st_size, sha256_prefix=digest, prefix_bytes=prefix_bytes)


def routing_stats_path(model_path: str | Path) -> Path:
    """``model.gguf`` -> ``model.routing.json`` beside it."""
    return Path(model_path).with_suffix(".routing.json")


@dataclass(frozen=True, eq=False)
class RoutingStats:
    """How often each (layer, expert) was routed to: ``counts`` [n_layers, n_expert] float64."""

    counts: torch.Tensor
    tokens: int  # tokens observed per layer; 0 for the uniform prior
    calibrated: bool

    def __post_init__(self) -> None:
        if self.counts.dim() != 2 or self.counts.numel() == 0:
            raise ValueError(f"counts must be a non-empty [n_layers, n_expert] table, got shape "
                             f"{tuple(self.counts.shape)}")
        if bool((self.counts < 0).any()) or not bool(torch.isfinite(self.counts).all()):
            raise ValueError("counts must be finite and non-negative")
        if self.tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {self.tokens}")

    @classmethod
    def uniform(cls, n_layers: int, n_expert: int) -> "RoutingStats":
        return cls(torch.ones(n_layers, n_expert, dtype=torch.float64), tokens=0, calibrated=False)

    @property
    def n_layers(self) -> int:
        return self.counts.shape[0]

    @property
    def n_expert(self) -> int:
        return self.counts.shape[1]

    def probabilities(self) -> torch.Tensor:
        """Per-layer routing mass [n_layers, n_expert]; a layer never observed counts as uniform."""
        c = self.counts.double()
        total = c.sum(1, keepdim=True)
        return torch.where(total > 0, c / total.clamp(min=1e-300), 1.0 / self.n_expert)

    def save(self, model_path: str | Path, path: str | Path | None = None) -> Path:
        """Write the statistics for ``model_path`` (to ``routing_stats_path(model_path)`` by default)."""
        fp = ModelFingerprint.of(model_path)
        out = Path(path) if path is not None else routing_stats_path(model_path)
        doc = {"format": STATS_FORMAT, "version": STATS_VERSION,
               "model": {"name": Path(model_path).name, "size": fp.size, "sha256_prefix": fp.sha256_prefix,
                         "prefix_bytes": fp.prefix_bytes},
               "n_layers": self.n_layers, "n_expert": self.n_expert, "tokens": self.tokens,
               "counts": [[int(c) if float(c).is_integer() else float(c) for c in row]
                          for row in self.counts.tolist()]}
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        tmp.replace(out)
        return out


def load_routing_stats(model_path: str | Path, cfg: ModelConfig, path: str | Path | None = None) -> RoutingStats:
    """The model's statistics; uniform when the file is absent, or (with a warning) stale."""
    src = Path(path) if path is not None else routing_stats_path(model_path)
    uniform = RoutingStats.uniform(cfg.n_layers, cfg.n_expert)
    if not src.exists():
        return uniform
    try:
        doc = json.loads(src.read_text())
        if doc.get("format") != STATS_FORMAT or doc.get("version") != STATS_VERSION:
            raise RoutingStatsError(f"{src}: format is {doc.get('format')!r} version {doc.get('version')!r}, "
                                    f"expected {STATS_FORMAT!r} version {STATS_VERSION}")
        model = doc["model"]
        recorded = ModelFingerprint(size=int(model["size"]), sha256_prefix=str(model["sha256_prefix"]),
                                    prefix_bytes=int(model["prefix_bytes"]))
        counts = torch.tensor(doc["counts"], dtype=torch.float64)
        tokens = int(doc["tokens"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RoutingStatsError(f"{src}: not a readable routing statistics file ({exc})") from None
    current = ModelFingerprint.of(model_path, recorded.prefix_bytes)
    if current != recorded:
        warnings.warn(f"{src} was recorded for another model file (size {recorded.size}, sha256 of the first "
                      f"{recorded.prefix_bytes} bytes {recorded.sha256_prefix[:12]}) than {model_path} (size "
                      f"{current.size}, {current.sha256_prefix[:12]}); using uniform routing statistics",
                      StaleRoutingStats, stacklevel=2)
        return uniform
    if tuple(counts.shape) != (cfg.n_layers, cfg.n_expert):
        raise RoutingStatsError(f"{src}: counts have shape {tuple(counts.shape)}, expected "
                                f"({cfg.n_layers}, {cfg.n_expert}) for this model")
    try:
        return RoutingStats(counts, tokens=tokens, calibrated=True)
    except ValueError as exc:
        raise RoutingStatsError(f"{src}: {exc}") from None


class RoutingCounter:
    """A routing observer that counts (layer, expert) hits on the device, without host syncs."""

    def __init__(self, n_layers: int, n_expert: int, device: torch.device | str):
        with torch.inference_mode(False):
            self.counts = torch.zeros(n_layers, n_expert, dtype=torch.int64, device=device)
            self.tokens = torch.zeros(n_layers, dtype=torch.int64, device=device)

    def __call__(self, layer_idx: int, topk_ids: torch.Tensor) -> None:
        flat = topk_ids.reshape(-1)
        self.counts[layer_idx].index_add_(0, flat, torch.ones_like(flat))  # bincount would sync on CUDA
        self.tokens[layer_idx].add_(topk_ids.shape[0])

    def stats(self) -> RoutingStats:
        tokens = self.tokens.cpu()
        return RoutingStats(self.counts.cpu().double(), tokens=int(tokens.max()), calibrated=True)


def calibrate_routing(model: Any, prompts: Sequence[Sequence[int]],
                      progress: Callable[[int, int], None] | None = None) -> RoutingStats:
    """Run ``model`` (a ``Qwen35MoE``) over each prompt and count its routing."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("calibration needs at least one prompt, and no empty prompt")
    cfg = model.cfg
    counter = RoutingCounter(cfg.n_layers, cfg.n_expert, model.device)
    previous = model.routing_observer
    model.set_routing_observer(counter)
    try:
        for i, prompt in enumerate(prompts):
            ids = torch.tensor(list(prompt), dtype=torch.long, device=model.device)
            model.forward(ids, model.new_state(len(prompt)), logits="none")
            if progress is not None:
                progress(i + 1, len(prompts))
    finally:
        model.set_routing_observer(previous)
    return counter.stats()


@dataclass(frozen=True)
class Placement:
    """The hot (GPU) experts of every layer for one budget, and what that costs and saves."""

    hot: tuple[tuple[int, ...], ...]  # per layer, ascending expert ids
    n_expert: int
    expert_bytes: tuple[int, ...]  # bytes of one expert on the GPU, per layer
    budget_mb: float
    expected_cold_hit_rate: float  # routing mass on cold experts, averaged over layers

    def __post_init__(self) -> None:
        if len(self.hot) != len(self.expert_bytes):
            raise ValueError(f"{len(self.hot)} hot sets for {len(self.expert_bytes)} layers")
        for layer, experts in enumerate(self.hot):
            if any(not 0 <= e < self.n_expert for e in experts) or list(experts) != sorted(set(experts)):
                raise ValueError(f"layer {layer}: hot experts {experts} are not distinct ids in [0, {self.n_expert})")

    @property
    def n_layers(self) -> int:
        return len(self.hot)

    @property
    def hot_count(self) -> int:
        return sum(len(h) for h in self.hot)

    @property
    def cold_count(self) -> int:
        return self.n_layers * self.n_expert - self.hot_count

    @property
    def hot_bytes(self) -> int:
        return sum(len(h) * b for h, b in zip(self.hot, self.expert_bytes))

    @property
    def cold_bytes(self) -> int:
        return sum((self.n_expert - len(h)) * b for h, b in zip(self.hot, self.expert_bytes))

    def hot_mask(self) -> torch.Tensor:
        """[n_layers, n_expert] bool."""
        mask = torch.zeros(self.n_layers, self.n_expert, dtype=torch.bool)
        for layer, experts in enumerate(self.hot):
            mask[layer, list(experts)] = True
        return mask

    def summary(self) -> dict[str, float | int]:
        return {"budget_mb": self.budget_mb, "hot_experts": self.hot_count, "cold_experts": self.cold_count,
                "hot_mb": self.hot_bytes / MB, "cold_mb": self.cold_bytes / MB,
                "expected_cold_hit_rate": self.expected_cold_hit_rate}


def min_nonzero_budget_mb(expert_bytes: Sequence[int], min_hot: int) -> float:
    """The smallest budget other than 0: ``min_hot`` experts in every layer."""
    return min_hot * sum(expert_bytes) / MB


PLACEMENT_UNITS = ("expert", "layer", "alternate")


def plan_placement(stats: RoutingStats, expert_bytes: Sequence[int], budget_mb: float, min_hot: int,
                   unit: str = "expert") -> Placement:
    """Choose the hot experts for ``budget_mb`` by greedy knapsack on routing mass per byte.

    Every layer first gets its ``min_hot`` most-routed experts; the rest are taken in one
    fixed order until the next one does not fit. ``unit="expert"``: mass per byte, then rank
    within the layer, then layer. ``unit="layer"``: whole layers at a time (the layer whose
    remaining experts carry the most mass per byte first, a later layer first on ties, as
    llama.cpp's ``-ncmoe`` keeps its last layers' experts on the GPU), each layer's experts
    by rank; fewer layers then have cold experts, each with more of them, which pays where
    a layer's cold experts cost a fixed price on top of their bytes (a CPU share's job, a
    gather's launch), and loses where routing is skewed enough that hot experts spread over
    every layer catch more of it. ``unit="alternate"``: whole layers too, every other layer first (the
    last, then every second one before it, most mass per byte first among them), so that up to half
    the layers hot each cold layer follows a hot one, whose time its cold experts' fetch ahead can
    use (``HybridExperts.set_cold_prefetch``). Stopping at the first item that does not fit, rather than
    skipping to smaller ones, keeps hot sets nested as the budget grows, so ``set_budget``
    only ever moves the difference. Budget 0 puts every expert on the CPU.
    """
    if unit not in PLACEMENT_UNITS:
        raise ConfigError(f"placement unit must be one of {', '.join(PLACEMENT_UNITS)}, got {unit!r}")
    L, E = stats.n_layers, stats.n_expert
    if len(expert_bytes) != L or any(b <= 0 for b in expert_bytes):
        raise ValueError(f"expert_bytes must give a positive size for each of {L} layers, got {expert_bytes}")
    if not 0 < min_hot <= E:
        raise ValueError(f"min_hot must be in [1, {E}], got {min_hot}")
    if not math.isfinite(budget_mb) or budget_mb < 0:
        raise ConfigError(f"expert budget must be a finite number of MB >= 0, got {budget_mb}")
    p = stats.probabilities()
    budget = int(budget_mb * MB)
    total = E * sum(expert_bytes)
    if budget >= total:
        hot = [list(range(E)) for _ in range(L)]
    elif budget == 0:
        hot = [[] for _ in range(L)]
    else:
        need = min_hot * sum(expert_bytes)
        if budget < need:
            raise ConfigError(
                f"expert budget {budget_mb:g} MB is below the {need / MB:.1f} MB that {min_hot} hot experts "
                f"(expert_used_count) in each of {L} layers take; use 0 to keep every expert on the CPU")
        rank = torch.argsort(torch.argsort(-p, dim=1, stable=True), dim=1)  # 0 = most routed in its layer
        hot = [torch.nonzero(rank[layer] < min_hot).flatten().tolist() for layer in range(L)]
        used = need
        if unit == "expert":
            rest = [(-float(p[l, e]) / expert_bytes[l], int(rank[l, e]), l, e)
                    for l in range(L) for e in range(E) if rank[l, e] >= min_hot]
        else:
            per_byte = [float(p[l][rank[l] >= min_hot].sum()) / (max(1, E - min_hot) * expert_bytes[l])
                        for l in range(L)]
            wave = [(L - 1 - l) % 2 if unit == "alternate" else 0 for l in range(L)]
            rest = [(wave[l], -per_byte[l], -l, int(rank[l, e]), l, e) for l in range(L) for e in range(E)
                    if rank[l, e] >= min_hot]
        rest.sort()
        for *_, layer, e in rest:
            if used + expert_bytes[layer] > budget:
                break
            hot[layer].append(e)
            used += expert_bytes[layer]
    hot_sets = tuple(tuple(sorted(h)) for h in hot)
    cold_mass = sum(float(p[l].sum() - p[l, list(h)].sum()) for l, h in enumerate(hot_sets)) / L
    return Placement(hot=hot_sets, n_expert=E, expert_bytes=tuple(int(b) for b in expert_bytes),
                     budget_mb=float(budget_mb), expected_cold_hit_rate=max(0.0, cold_mass))


def state_bytes(cfg: ModelConfig, context_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one sequence's state: KV caches for ``context_tokens`` plus GDN conv and recurrent states."""
    elt = torch.empty((), dtype=dtype).element_size()
    kv = len(cfg.attention_layers) * 2 * cfg.n_head_kv * cfg.head_dim * context_tokens * elt
    recurrent = cfg.gdn_v_heads * cfg.gdn_head_k * cfg.gdn_head_v * 4  # float32
    conv = (cfg.conv_kernel - 1) * cfg.gdn_conv_dim * elt
    return kv + len(cfg.gdn_layers) * (recurrent + conv)


@dataclass(frozen=True)
class GpuReserve:
    """GPU memory kept away from experts besides the non-expert weights already resident."""

    state_mb: float = 0.0  # KV caches and GDN states of the sequences to be run
    margin_mb: float = 1024.0  # activations, allocator slack, CUDA graphs
    draft_mb: float = 0.0  # a DFlash draft loaded after the experts

    def __post_init__(self) -> None:
        for name in ("state_mb", "margin_mb", "draft_mb"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    @property
    def total_bytes(self) -> int:
        return int((self.state_mb + self.margin_mb + self.draft_mb) * MB)


def gpu_expert_capacity_mb(device: torch.device, reclaimable_bytes: int, reserve: GpuReserve) -> float | None:
    """MB the experts may take on the live GPU: free memory (including the caching allocator's
    unused blocks) plus expert memory that a new placement would release, minus the reserve.
    None off CUDA, where both tiers share host memory."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return (free + cached + reclaimable_bytes - reserve.total_bytes) / MB


def check_fits(placement: Placement, capacity_mb: float | None, device: torch.device, reserve: GpuReserve) -> None:
    """Refuse a placement whose hot experts would not fit in ``capacity_mb``."""
    if capacity_mb is None or placement.hot_bytes <= capacity_mb * MB:
        return
    largest = max(0.0, math.floor(capacity_mb))
    raise ConfigError(
        f"expert budget {placement.budget_mb:g} MB ({placement.hot_bytes / MB:.0f} MB of hot experts) does not fit "
        f"on {device}: with the non-expert weights resident, {reserve.state_mb:g} MB of KV cache and states, "
        f"{reserve.draft_mb:g} MB for a draft and a {reserve.margin_mb:g} MB safety margin, the largest "
        f"expert budget that fits is {largest:.0f} MB")
