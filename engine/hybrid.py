"""Hybrid expert executor: hot experts on the GPU, cold experts in host memory.

Every routed expert keeps a master copy in host memory: dense tensors (pinned when the device
is CUDA), or with ``cold_format="quantized"`` the GGUF blocks packed for torch's CPU weight-only
kernels (``engine.kernels.cpu_quant``; device slots are then filled by dequantizing the file's
raw blocks). The hot experts of each layer are also copied into that layer's device slots, where
the fused-MoE kernel runs them; pairs routed to cold experts are computed on a thread pool
from host memory while the GPU works, and the two partial sums are added on the device.
``set_budget`` re-plans the placement and moves only the experts that change tier.

Where the cold experts are computed is ``cold_device``:
  ``cpu``  CPU threads, as above. A layer with cold experts reads its routing back to the host
           once per call (the cold tier cannot start without it).
  ``gpu``  the GPU, reading the pinned master copies over the bus (the host memory is mapped
           into the device's address space; no expert of the cold tier takes device memory).
           Calls of up to ``n_expert / top_k`` tokens read each routed pair's cold expert once:
           no more bus traffic than copying every cold expert. Up to ``STREAM_EXPERTS`` pairs
           (decode), one launch first copies those experts whole into a device buffer
           (``engine.kernels.gather``: long contiguous reads, which the bus carries about four
           times faster than the expert kernels' scattered ones) and the expert launches read it
           there; more pairs are read in place (``LUCE_TUNE_COLD_GATHER=0``: always in place).
           ``set_cpu_share`` hands a share of each layer's cold experts to native CPU threads in
           decode-sized calls, which compute them from the same pinned copies while the bus carries
           the rest (``engine.kernels.host_experts``; still no host sync, still captured).
           Longer calls (prefill) copy the layer's cold experts in
           runs of ``STREAM_EXPERTS`` into a device buffer and compute each run there. Nothing
           waits for the host, so with the Triton kernels a step with cold experts is captured
           in a CUDA graph like an all-hot one.

A layer whose experts are all hot runs without host syncs, and a placement that never waits
for the host (every expert hot, or ``cold_device="gpu"``) is ``graph_safe``: the hot-hit counters
are device tensors, so they also count inside a replayed CUDA graph, and the pair counts (a call's
count is its shape's) are kept on the host and added again at each replay (``host_counts``). On a CPU-only machine
both tiers live in host memory (hot experts are then held twice) and the same code paths run.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES

from engine.errors import ConfigError
from engine.gguf import quants
from engine.kernels.cpu_quant import CpuQuantMatrix
from engine.kernels.host_experts import WARM_MAX  # cold experts a layer's CPU threads may warm ahead
from engine.kernels.moe import experts_sum, fused_moe, resolve_impl, routed_experts
from engine.kernels.quant.reference import (SPLIT_QTYPES, QuantExperts, QuantMatrix, join_rows, row_bytes,
                                            split_layout_on, split_rows)
from engine.kernels.quant.reference import resolve_impl as resolve_quant_impl
from engine.model.host_memory import mapped_view
from engine.placement import (MB, PLACEMENT_UNITS, GpuReserve, Placement, RoutingStats, check_fits,
                              gpu_expert_capacity_mb, plan_placement, state_bytes)

if TYPE_CHECKING:
    from engine.kernels.moe.triton import MoEKernelConfig
    from engine.model.weights import RawExpertMatrix, RawTensorSource, SharedExpertWeights

RESERVED_CONTEXT_TOKENS = 32768  # state kept free for by default when placing experts
COLD_FORMATS = ("dense", "quantized")
HOT_FORMATS = ("dense", "quantized")
COLD_DEVICES = ("cpu", "gpu")
STREAM_EXPERTS = 32  # cold experts copied to the device at once for a long call with cold_device="gpu"
STAGED_ENV = "LUCE_TUNE_HYBRID_STAGED"  # 0: decode-sized calls with cold experts take the launches of __call__
OVERLAP_ENV = "LUCE_TUNE_HYBRID_OVERLAP"  # 0: the staged path's bus copies on the compute stream, one expert launch
COLD_GATHER_ENV = "LUCE_TUNE_COLD_GATHER"  # 0: decode-sized calls read the cold experts in place
PREFETCH_MAX = 4  # cold experts a layer's bus may fetch ahead of its router (``set_cold_prefetch``)
# None: decode-sized calls gather the cold experts on CUDA (unless LUCE_TUNE_COLD_GATHER=0); True: off CUDA
# too (tests, with TRITON_INTERPRET=1); False: never.
COLD_GATHER: bool | None = None
_UPLOAD_EXPERTS = 16  # experts dequantized per step when filling device slots from raw blocks


@dataclass(frozen=True)
class HybridStats:
    """Expert hits since the last ``reset_counters`` and the placement they ran under."""

    budget_mb: float
    hot_experts: int
    cold_experts: int
    hot_hits: int  # routed (token, expert) pairs served on the device
    cold_hits: int  # routed pairs served from host memory (CPU threads, or the device over the bus)
    expected_cold_hit_rate: float  # from the routing statistics
    expert_vram_mb: float  # device memory held by hot experts
    expert_host_mb: float = 0.0  # host memory held by the master copies of all experts
    cold_cpu_share: float = 0.0  # share of the cold mass CPU threads compute beside the bus (cold_device="gpu")
    cold_prefetch: int = 0  # cold experts a layer the bus fetches ahead of its router (set_cold_prefetch)
    cold_warm: int = 0  # cold experts a layer the CPU threads warm ahead of its router (set_cold_prefetch)
    prefetched: int = 0  # cold experts fetched or warmed ahead
    prefetch_served: int = 0  # cold pairs computed from experts fetched or warmed ahead

    @property
    def cold_hit_rate(self) -> float:
        total = self.hot_hits + self.cold_hits
        return self.cold_hits / total if total else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self) | {"cold_hit_rate": self.cold_hit_rate}


class DenseExperts:
    """One layer's master copies as dense stacks: gate, up [E, ffn, H], down [E, H, ffn]."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        self.tensors = (gate, up, down)
        self.n_expert = gate.shape[0]
        self.dtype = gate.dtype  # of the device slots
        self.expert_shapes = tuple(tuple(t.shape[1:]) for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def upload(self, slots: tuple[torch.Tensor, ...], dst: int, src: int, n: int) -> None:
        """Copy experts ``src .. src+n-1`` into slots ``dst .. dst+n-1``."""
        for new, host in zip(slots, self.tensors):
            new[dst:dst + n].copy_(host[src:src + n], non_blocking=True)

    def experts_sum(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: list[int]) -> torch.Tensor:
        return experts_sum(x, *self.tensors, ids, w, experts)

    def mapped(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Every expert as ``device`` tensors over the host copies (``mapped_view``)."""
        return tuple(mapped_view(t, device) for t in self.tensors)

    def as_experts(self, slots: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Stacks of this layout (device slots, a mapped view) as the routed-expert kernel takes them."""
        return slots

    @staticmethod
    def moe(x: torch.Tensor, experts: tuple[torch.Tensor, ...], ids: torch.Tensor, w: torch.Tensor, impl: str,
            config: "MoEKernelConfig | None") -> torch.Tensor:
        return fused_moe(x, *experts, ids, w, impl=impl, config=config)


class QuantizedExperts:
    """One layer's master copies in their GGUF quantized form.

    The CPU tier multiplies ``CpuQuantMatrix`` packs. Device slots are filled from the raw
    blocks (views of the mapped file, so they cost no private host memory): dequantized on the
    device with ``hot_format="dense"``, copied as they are with ``"quantized"`` (the slots then
    hold uint8 [n_hot, rows, row_bytes] and the budget counts quantized bytes).
    """

    def __init__(self, raw: "Sequence[RawExpertMatrix]", dtype: torch.dtype, *,
                 cold_dtype: torch.dtype = torch.bfloat16, hot_format: str = "dense", cold_device: str = "cpu",
                 pin: bool = False, split: bool = False):
        """``raw``: (gate, up, down); ``dtype``: the model's (and dense slots'); ``cold_dtype``: the
        CPU kernels' compute dtype (bfloat16 is their fast path, float32 their exact one).

        ``cold_device="cpu"`` packs every expert for the CPU kernels; ``"gpu"`` copies the blocks
        into host memory (pinned with ``pin``, for the device to read) and packs nothing. Device
        slots read from those copies when they exist, from the file otherwise. ``split`` keeps
        Q4_0/Q8_0 blocks that the device reads (slots, host copies) in the split row layout
        (``engine.kernels.quant.reference.split_rows``), which its kernels load as vectors."""
        if hot_format not in HOT_FORMATS:
            raise ConfigError(f"hot format must be one of {', '.join(HOT_FORMATS)}, got {hot_format!r}")
        self.raw = tuple(raw)
        self.n_expert = self.raw[0].data.shape[0]
        self.hot_quantized = hot_format == "quantized"
        self.dtype = torch.uint8 if self.hot_quantized else dtype  # of the device slots
        self.expert_shapes = tuple((r.rows, row_bytes(r.qtype, r.cols)) if self.hot_quantized else (r.rows, r.cols)
                                   for r in self.raw)
        self.layouts = tuple("split" if split and r.qtype in SPLIT_QTYPES else "ggml" for r in self.raw)
        self._cold_dtype = cold_dtype
        self._matrices: list[tuple[CpuQuantMatrix, ...]] | None = None
        self.blocks: tuple[torch.Tensor, ...] | None = None  # uint8 [E, rows, row_bytes] per matrix, in layouts
        if cold_device == "gpu":
            self.blocks = tuple(_host_blocks(r, pin, layout) for r, layout in zip(self.raw, self.layouts))
        else:
            self.matrices  # noqa: B018 (packed now, not in the first call that needs them)

    @property
    def matrices(self) -> list[tuple[CpuQuantMatrix, ...]]:
        """Per expert (gate, up, down) packed for torch's CPU kernels, built on first use."""
        if self._matrices is None:
            self._matrices = [tuple(CpuQuantMatrix.from_raw(r.expert(e), r.qtype, r.rows, r.cols,
                                                            dtype=self._cold_dtype)
                                    for r in self.raw) for e in range(self.n_expert)]
        return self._matrices

    def slot_experts(self, slots: tuple[torch.Tensor, ...]) -> tuple[QuantExperts, ...]:
        """Quantized stacks (device slots, a mapped view) as ``QuantExperts`` (gate, up, down)."""
        return tuple(QuantExperts(slot, r.qtype, slot.shape[0], r.rows, r.cols, layout)
                     for slot, r, layout in zip(slots, self.raw, self.layouts))

    def as_experts(self, slots: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | tuple[QuantExperts, ...]:
        """Stacks of the slots' layout as the routed-expert kernels take them."""
        return self.slot_experts(slots) if self.hot_quantized else slots

    def mapped(self, device: torch.device) -> tuple[QuantExperts, ...]:
        """Every expert's blocks as ``device`` tensors over the host copies (``mapped_view``)."""
        if self.blocks is None:
            raise ConfigError("quantized experts read in place by the device need cold_device='gpu'")
        return self.slot_experts(tuple(mapped_view(b, device) for b in self.blocks))

    def moe(self, x: torch.Tensor, experts: tuple[torch.Tensor, ...] | tuple[QuantExperts, ...], ids: torch.Tensor,
            w: torch.Tensor, impl: str, config: "MoEKernelConfig | None") -> torch.Tensor:
        if isinstance(experts[0], QuantExperts):
            return quantized_moe(x, experts, ids, w, impl=impl)
        return fused_moe(x, *experts, ids, w, impl=impl, config=config)

    @property
    def nbytes(self) -> int:
        held = sum(m.nbytes for expert in self._matrices for m in expert) if self._matrices else 0
        return held + sum(b.numel() for b in self.blocks or ())

    def upload(self, slots: tuple[torch.Tensor, ...], dst: int, src: int, n: int) -> None:
        """Fill slots ``dst .. dst+n-1`` with experts ``src .. src+n-1`` (dequantized, or as raw blocks)."""
        for i, (slot, r, layout) in enumerate(zip(slots, self.raw, self.layouts)):
            for a in range(0, n, _UPLOAD_EXPERTS):
                b = min(n, a + _UPLOAD_EXPERTS)
                if self.blocks is not None and self.hot_quantized:  # already in the slots' layout: one copy
                    slot[dst + a:dst + b].copy_(self.blocks[i][src + a:src + b], non_blocking=True)
                    continue
                if self.blocks is not None:  # pinned on CUDA: the copy is queued, not waited for
                    data, held = self.blocks[i][src + a:src + b].to(slot.device, non_blocking=True), layout
                else:
                    data, held = torch.from_numpy(r.data[src + a:src + b].copy()).to(slot.device), "ggml"
                rows = data.reshape((b - a) * r.rows, -1)
                if self.hot_quantized:  # the file's blocks, into the slots' layout
                    rows = split_rows(rows, r.qtype) if layout == "split" else rows
                    slot[dst + a:dst + b].copy_(rows.view(b - a, *slot.shape[1:]))
                else:
                    ggml = join_rows(rows, r.qtype) if held == "split" else rows
                    slot[dst + a:dst + b].copy_(quants.dequantize(ggml, r.qtype, (b - a, r.rows, r.cols)))

    def experts_sum(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: list[int]) -> torch.Tensor:
        """Float32 [T, H] contribution of ``experts`` (as ``engine.kernels.moe.experts_sum``)."""
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in experts:
            tok, slot = (ids == e).nonzero(as_tuple=True)  # [n], [n]
            xs = x[tok]  # [n, H]
            gate, up, down = self.matrices[e]
            act = F.silu(gate.matmul(xs)) * up.matmul(xs)  # [n, ffn]
            y = down.matmul(act).float()  # [n, H]
            out.index_add_(0, tok, y * w[tok, slot].float().unsqueeze(1))
        return out


HostExperts = DenseExperts | QuantizedExperts


class _LayerTiers:
    """One layer's experts: all of them in host memory, the hot ones also in device slots."""

    def __init__(self, host: HostExperts, device: torch.device):
        self.host = host
        self.device = device
        self.n_expert = host.n_expert
        self.hot: tuple[int, ...] = ()  # expert held in each slot
        self.slots: tuple[torch.Tensor, ...] | None = None  # (gate, up, down) [n_hot, ...] on device
        self.slot_experts: tuple[Any, ...] | None = None  # the slots as the routed-expert kernel takes them
        self.host_hot = torch.zeros(self.n_expert, dtype=torch.bool)
        self.slot_of = torch.full((self.n_expert,), -1, dtype=torch.int64, device=device)
        self.cold_of = torch.arange(self.n_expert, device=device)  # expert id where cold, -1 where hot
        # with a CPU share (``HybridExperts.set_cpu_share``): the cold experts the bus still carries, and int8
        # flags of those the CPU threads compute in decode-sized calls
        self.bus_cold_of = torch.arange(self.n_expert, device=device)
        self.mine = torch.zeros(self.n_expert, dtype=torch.int8, device=device)
        self.n_mine = 0
        self.mapped: tuple[Any, ...] | None = None  # every expert in host memory, read by the device (cold_device="gpu")
        self.cold_runs = _cold_runs([False] * self.n_expert)  # (first expert, count) of runs of cold experts

    @property
    def n_hot(self) -> int:
        return len(self.hot)

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots) if self.slots else 0

    def place(self, hot: Sequence[int]) -> None:
        """Make exactly ``hot`` resident in new slots: experts that stay hot are copied on the
        device, newly hot ones from host memory (the old slots are freed afterwards)."""
        old = {e: s for s, e in enumerate(self.hot)}
        order = sorted(hot)
        if order == sorted(old):
            return
        slots = None
        if order:
            slots = tuple(torch.empty((len(order), *shape), dtype=self.host.dtype, device=self.device)
                          for shape in self.host.expert_shapes)
            kept = [(s, old[e]) for s, e in enumerate(order) if e in old]
            incoming = [(s, e) for s, e in enumerate(order) if e not in old]
            for dst, src, n in _runs(kept):
                for new, prev in zip(slots, self.slots):
                    new[dst:dst + n].copy_(prev[src:src + n])
            for dst, src, n in _runs(incoming):
                self.host.upload(slots, dst, src, n)
        self.slots = slots
        self.slot_experts = self.host.as_experts(slots) if slots is not None else None
        self.hot = tuple(order)
        slot_of = torch.full((self.n_expert,), -1, dtype=torch.int64)
        if order:
            slot_of[torch.tensor(order)] = torch.arange(len(order))
        self.slot_of.copy_(slot_of)
        self.host_hot = slot_of >= 0
        self.cold_of.copy_(torch.where(self.host_hot, -1, torch.arange(self.n_expert)))
        self.cold_runs = _cold_runs(self.host_hot.tolist())
        self.assign_cpu(())

    def assign_cpu(self, experts: Sequence[int]) -> None:
        """Make ``experts`` (cold ones) the layer's CPU set; the bus carries the other cold experts."""
        mine = torch.zeros(self.n_expert, dtype=torch.int8)
        if experts:
            mine[torch.tensor(list(experts))] = 1
        if bool((mine.bool() & self.host_hot).any()):
            raise ValueError("only cold experts can be computed by the CPU threads")
        self.mine.copy_(mine)
        self.n_mine = int(mine.sum())
        self.bus_cold_of.copy_(torch.where(self.host_hot | mine.bool(), -1, torch.arange(self.n_expert)))

    def hot_moe(self, x: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, impl: str,
                config: "MoEKernelConfig | None") -> torch.Tensor:
        """The hot experts' output [T, H] in x's dtype; ``slots`` [T, k] index the device slots (-1: cold)."""
        return self.host.moe(x, self.slot_experts, slots, w, impl, config)


def quantized_moe(x: torch.Tensor, experts: Sequence[QuantExperts], ids: torch.Tensor, w: torch.Tensor, *,
                  impl: str = "auto") -> torch.Tensor:
    """Routed-expert SwiGLU over quantized (gate, up, down) experts: [T, H] in x's dtype.

    Pairs with a negative id contribute nothing. The Triton path (CUDA, or ``impl="triton"``)
    dequantizes in registers in two launches, gate and up together, then down with each
    token's weighted sum over its pairs, and never synchronises the host; the torch path is the
    reference: one quantized matmul per projection over every pair, then the weighted sum.
    """
    gate, up, down = experts
    if resolve_quant_impl(impl, x.device) == "triton":
        from engine.kernels.quant.triton import quantized_moe_triton

        return quantized_moe_triton(x, gate, up, down, ids, w)
    T, k = ids.shape
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)  # [T k, H]: pair p = t k + j reads token t
    act = (F.silu(gate.matmul(xs, flat, impl).float()) * up.matmul(xs, flat, impl).float()).to(x.dtype)
    y = down.matmul(act, flat, impl).float()  # [T k, H]
    return (y * w.reshape(-1, 1).float()).view(T, k, -1).sum(1).to(x.dtype)


SHARED_IN_MOE_ENV = "LUCE_TUNE_SHARED_IN_MOE"


def routing_predictor(router: torch.Tensor, attn: torch.Tensor, post: torch.Tensor, *,
                      device: torch.device | str) -> torch.Tensor:
    """A float32 router [E, H] on ``device`` such that the top-k of ``x @ predictor.T``, with ``x`` a layer's mixer
    input ``rms_norm(h) * attn``, is the layer's routing had its mixer added nothing (the router's input is
    ``rms_norm(h + mixed) * post``; top-k does not see the norm's scale): the router with ``post / attn`` folded
    into its columns, so that predicting is one router launch on ``x`` as it is. An ``attn`` weight near 0 takes
    ``post`` alone there (``HybridExperts.set_predictors``)."""
    a, b = attn.detach().float(), post.detach().float()
    scale = torch.where(a.abs() > 1e-3 * a.abs().max().clamp(min=1e-30), b / a, b)
    return (router.detach().float() * scale.to(router.device)).to(device).contiguous()


def ahead_predictors(layers: "Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]", *,
                     device: torch.device | str, by: int = 1) -> list[torch.Tensor | None]:
    """Per layer (router, attn norm, post norm), each layer's ``routing_predictor`` from the mixer input of the
    layer ``by`` before it (``HybridExperts.set_cold_prefetch(ahead=True)`` takes ``by`` 1): that layer's ``attn``
    under this layer's ``post``, the mixers and the experts between left out; None for the first ``by`` layers."""
    if by < 1:
        raise ValueError(f"a prediction ahead is at least a layer before, got {by}")
    return [None] * min(by, len(layers)) + [routing_predictor(router, before[1], post, device=device)
                                            for before, (router, _, post) in zip(layers, layers[by:])]


class HybridExperts:
    """The model's expert executor under a VRAM budget (``Qwen35MoE.set_expert_executor``)."""

    def __init__(self, host_experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | HostExperts],
                 budget_mb: float, *, device: torch.device | str, stats: RoutingStats, min_hot: int,
                 reserve: GpuReserve | None = None, max_expert_mb: float | None = None,
                 threads: int | None = None, impl: str = "auto", kernel_config: "MoEKernelConfig | None" = None,
                 gguf_file: "RawTensorSource | None" = None, cold_device: str = "cpu",
                 cpu_share: float | None = None, cpu_int8: bool | None = None, unit: str | None = None,
                 cold_prefetch: int | None = None, cold_warm: int | None = None):
        """``host_experts``: per layer (gate, up, down) in host memory (pinned for CUDA) or a
        ``QuantizedExperts``, placed for ``budget_mb``. ``max_expert_mb`` caps device memory for
        experts below what the live GPU allows; ``threads`` sizes the CPU pool; ``impl`` picks the
        device kernels; ``gguf_file`` is the file the quantized experts view, closed by ``close``;
        ``cold_device`` computes the cold experts on CPU threads or on the device (module docstring);
        ``cpu_share`` (with ``cold_device="gpu"``; default ``LUCE_TUNE_COLD_CPU_SHARE`` or 0) hands that share of
        the cold experts' routed mass to CPU threads in decode-sized calls (``set_cpu_share``), whose
        activations are 8-bit (``cpu_int8``, default ``LUCE_TUNE_COLD_CPU_INT8`` or on) or float32. ``unit`` (default
        ``LUCE_TUNE_PLACEMENT_UNIT`` or ``"expert"``): what the hot set grows by (``plan_placement``).
        ``cold_prefetch`` (default ``LUCE_TUNE_COLD_PREFETCH`` or 0) and ``cold_warm`` (default
        ``LUCE_TUNE_COLD_WARM`` or 0): cold experts the bus fetches, and the CPU threads warm, ahead of each
        layer's router from its predicted routing (``set_cold_prefetch``)."""
        if cold_device not in COLD_DEVICES:
            raise ConfigError(f"cold device must be one of {', '.join(COLD_DEVICES)}, got {cold_device!r}")
        self.cold_device = cold_device
        self.device = torch.device(device)
        self.cpu_share = 0.0
        self.cpu_int8 = _env_flag(COLD_CPU_INT8_ENV) if cpu_int8 is None else bool(cpu_int8)
        self._host_share: Any = None  # engine.kernels.host_experts.HostShare, started by the first share > 0
        self._threads_given = threads is not None
        if len(host_experts) != stats.n_layers:
            raise ValueError(f"{len(host_experts)} layers of experts but routing statistics for {stats.n_layers}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.stats = stats
        self.min_hot = min_hot
        self.unit = _env_unit() if unit is None else unit
        if self.unit not in PLACEMENT_UNITS:
            raise ConfigError(f"placement unit must be one of {', '.join(PLACEMENT_UNITS)}, got {self.unit!r}")
        self.reserve = reserve or GpuReserve()
        self.max_expert_mb = max_expert_mb
        self.impl = resolve_impl(impl, self.device)
        self.kernel_config = kernel_config
        self.threads = threads or min(8, os.cpu_count() or 1)
        hosts = [layer if isinstance(layer, (DenseExperts, QuantizedExperts)) else DenseExperts(*layer)
                 for layer in host_experts]
        self.expert_bytes = [sum(math.prod(shape) for shape in h.expert_shapes) * h.dtype.itemsize for h in hosts]
        self._gguf_file = gguf_file
        with torch.inference_mode(False):
            self._layers = [_LayerTiers(host, self.device) for host in hosts]
            if cold_device == "gpu":
                try:
                    for layer in self._layers:
                        layer.mapped = layer.host.mapped(self.device)
                except (RuntimeError, ValueError, TypeError) as exc:
                    raise ConfigError(f"cold_device='gpu': {self.device} cannot read the experts' host copies in "
                                      f"place ({exc}); use cold_device='cpu'") from exc
            self._stream_buffers_by_layout: dict[Any, tuple[torch.Tensor, ...]] = {}
            self._pair_rows: dict[tuple[int, int], torch.Tensor] = {}
            self._hot_hits = torch.zeros(len(self._layers), dtype=torch.int64, device=self.device)
            self._stream: torch.cuda.Stream | None = None  # the staged path's second stream (CUDA)
            # pairs taken off by ``discount`` (device scalars); the pairs counted are ``_host_pairs``
            self._pairs = torch.zeros(len(self._layers), dtype=torch.int64, device=self.device)
        # Routed pairs per layer, counted on the host: a call's count is its shape's, so a captured step
        # adds what one run counted at each replay (``host_counts``, ``add_host_counts``) rather than
        # launching an add per layer inside the graph.
        self._host_pairs = [0] * len(self._layers)
        self.placement_version = 0  # bumped by every set_budget: device slots may have been reallocated
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="cold-experts")
        self.placement: Placement
        self.cold_prefetch = self.cold_warm = 0
        self.cold_ahead = _env_flag(COLD_AHEAD_ENV)
        self._predictors: list[torch.Tensor] | None = None  # a router with the norms folded in, a layer
        self._ahead_predictors: list[torch.Tensor | None] = []  # the same from the layer before's input
        self.ahead_route = _env_choice(AHEAD_ROUTE_ENV, AHEAD_ROUTES)
        self.fetch_programs = _env_programs() or None
        self.fetch_copier = _env_choice(FETCH_COPIER_ENV, FETCH_COPIERS)
        self._buses: dict[Any, Any] = {}  # engine.kernels.host_experts.HostBus per stage layout, made on first use
        # (layer, fetched ids or None, warmed ids or None, event, the copier or None): for the layer's split
        self._fetch: tuple[int, torch.Tensor | None, torch.Tensor | None, Any, Any] | None = None
        with torch.inference_mode(False):
            # cold pairs served from experts fetched ahead, and experts fetched ahead, per layer
            self._fetch_hits = torch.zeros(len(self._layers), dtype=torch.int64, device=self.device)
            self._fetch_sent = torch.zeros(len(self._layers), dtype=torch.int64, device=self.device)
        self._two_streams = [False] * len(self._layers)  # the layer's last one-token call took two streams
        self.set_cold_prefetch(_env_prefetch(COLD_PREFETCH_ENV) if cold_prefetch is None else cold_prefetch,
                               warm=_env_prefetch(COLD_WARM_ENV, WARM_MAX) if cold_warm is None else cold_warm)
        self.set_budget(budget_mb)
        if cpu_share is None:
            cpu_share = _env_share()
        if cpu_share:
            self.set_cpu_share(cpu_share)

    @classmethod
    def from_model(cls, model: Any, budget_mb: float, stats: RoutingStats | None = None, *,
                   reserve: GpuReserve | None = None, cold_format: str = "dense",
                   gguf_file: "RawTensorSource | None" = None, cold_dtype: torch.dtype = torch.bfloat16,
                   hot_format: str = "dense", cold_device: str = "cpu", split: bool | None = None,
                   **options: Any) -> "HybridExperts":
        """Take over the routed experts of ``model`` (a ``Qwen35MoE``) and place them for ``budget_mb``.

        The budget is checked before anything moves. With ``cold_format="dense"`` the model's
        expert tensors are replaced by their host copies, so device memory holds only the hot
        slots; with ``"quantized"`` the master copies are built from ``gguf_file`` (the model's file,
        kept open for the device slots) and the model's dense expert tensors are released
        (left as meta tensors of the same shapes). ``hot_format="quantized"`` (with the quantized
        cold format) keeps the hot experts' device slots in their GGUF blocks too, run by the
        quantized-expert kernels; the budget then counts quantized bytes, as on the appliance.
        ``cold_device="gpu"`` has the device compute the cold experts from host memory (module
        docstring). ``split`` (default: ``split_layout_on`` the model's device) keeps the Q4_0/Q8_0
        blocks the device reads in the split row layout (``QuantizedExperts``).
        """
        if cold_format not in COLD_FORMATS:
            raise ConfigError(f"cold format must be one of {', '.join(COLD_FORMATS)}, got {cold_format!r}")
        if cold_format == "quantized" and gguf_file is None:
            raise ConfigError("the quantized cold format needs the model's GGUF file (gguf_file=...)")
        if hot_format not in HOT_FORMATS:
            raise ConfigError(f"hot format must be one of {', '.join(HOT_FORMATS)}, got {hot_format!r}")
        if hot_format == "quantized" and cold_format != "quantized":
            raise ConfigError("quantized hot experts need the quantized cold format (cold_format='quantized')")
        if cold_device not in COLD_DEVICES:
            raise ConfigError(f"cold device must be one of {', '.join(COLD_DEVICES)}, got {cold_device!r}")
        cfg = model.cfg
        stats = stats or RoutingStats.uniform(cfg.n_layers, cfg.n_expert)
        if reserve is None:
            context = min(cfg.context_length, RESERVED_CONTEXT_TOKENS)
            reserve = GpuReserve(state_mb=state_bytes(cfg, context, model.dtype) / MB)
        experts = [layer.moe.experts for layer in model.weights.layers]
        on_gpu = sum(t.numel() * t.element_size() for ew in experts for t in (ew.gate, ew.up, ew.down)
                     if t.device.type == "cuda")
        raws = None
        if cold_format == "quantized":
            from engine.model.weights import raw_experts

            raws = raw_experts(gguf_file, cfg)
        if hot_format == "quantized":
            expert_bytes = [sum(r.rows * row_bytes(r.qtype, r.cols) for r in raw) for raw in raws]
        else:
            expert_bytes = [sum(t[0].numel() for t in (ew.gate, ew.up, ew.down)) * ew.gate.element_size()
                            for ew in experts]
        if options.get("unit") is None:
            options["unit"] = _env_unit()
        _checked_placement(stats, expert_bytes, budget_mb, cfg.n_expert_used, torch.device(model.device),
                           on_gpu, reserve, options.get("max_expert_mb"), options["unit"])
        pin = torch.device(model.device).type == "cuda"
        host: list[Any] = []
        if raws is not None:
            for ew, raw in zip(experts, raws):
                host.append(QuantizedExperts(raw, model.dtype, cold_dtype=cold_dtype, hot_format=hot_format,
                                             cold_device=cold_device, pin=pin,
                                             split=split_layout_on(model.device) if split is None else split))
                ew.gate, ew.up, ew.down = (torch.empty(t.shape, dtype=t.dtype, device="meta")
                                           for t in (ew.gate, ew.up, ew.down))
        else:
            for ew in experts:
                ew.gate, ew.up, ew.down = (_host_copy(t, pin) for t in (ew.gate, ew.up, ew.down))
                host.append((ew.gate, ew.up, ew.down))
        if pin:
            torch.cuda.empty_cache()
        hybrid = cls(host, budget_mb, device=model.device, stats=stats, min_hot=cfg.n_expert_used, reserve=reserve,
                     gguf_file=gguf_file, cold_device=cold_device, **options)
        hybrid.set_predictors([(layer.moe.router, layer.attn_norm, layer.post_norm) for layer in model.weights.layers])
        return hybrid

    def set_predictors(self, layers: "Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]") -> None:
        """Each layer's router [E, H] and the norm weights [H] before its mixer and before its experts, from
        which ``begin_layer`` predicts the layer's routing from the mixer's input: the router's input is
        ``rms_norm(h + mixed) * post``; the mixer's, ``x = rms_norm(h) * attn``; with ``mixed`` left out,
        ``x * post / attn`` is proportional to it, and top-k does not see the scale (an ``attn`` weight near 0
        takes ``post`` alone there)."""
        if len(layers) != len(self._layers):
            raise ValueError(f"{len(layers)} layers of predictors for {len(self._layers)} layers of experts")
        self._predictors = [routing_predictor(*layer, device=self.device) for layer in layers]
        self._ahead_predictors = ahead_predictors(layers, device=self.device)

    def set_cold_prefetch(self, n: int, *, warm: int | None = None, ahead: bool | None = None,
                          route: str | None = None, programs: int | None = None, copier: str | None = None) -> None:
        """Fetch up to ``n`` (0 to ``PREFETCH_MAX``) cold experts a layer ahead of its router in decode steps
        of one token on the staged path with a CPU share (``_staged_moe``): at the layer's start the routing
        is predicted from the mixer's input (``set_predictors``), and the bus copies its first ``n`` cold
        experts into the stage while the mixer runs. ``warm`` (None: as set; 0 to ``WARM_MAX``): the
        next ones are named to the CPU threads, which fetch their blocks into their caches meanwhile
        (``HostShare.warm``) and are handed those experts' pairs whatever the share. ``ahead`` (None: as set,
        at first ``LUCE_TUNE_COLD_AHEAD`` or on): a cold layer after one whose experts are all hot is predicted
        a layer earlier, at that layer's start, so that the fetch and the warm-up have both layers' time, in
        which neither the bus nor the threads have other work (placement ``"alternate"`` puts a hot layer
        before each cold one). ``route`` (None: as set, at first ``LUCE_TUNE_AHEAD_ROUTE`` or ``"main"``): where the
        predicting router runs, ``"main"`` on the step's own stream at the layer's start, the whole device for a
        few microseconds, so that the threads' warm-up starts at once (half-cold decode 2.6% faster than
        ``"side"`` on one H100 host: docs/benchmarks.md, twentieth round), ``"side"`` on the second stream in a
        few programs beside the layer's kernels (the eighteenth round's 54 us a launch there: it waits for their
        SMs). ``programs`` (None: as set, at first
        ``LUCE_TUNE_FETCH_PROGRAMS`` or ``FETCH_PROGRAMS_DEFAULT``; 0: one program a block): the bus's fetch ahead
        in at most that many programs looping over the blocks (``gather_stacks(programs=)``), so that it holds a few
        SMs beside the layer rather than queueing in front of its kernels (8 programs: half-cold decode 4% faster
        with one expert fetched than with none, where one program a block and 32 programs lost: docs/benchmarks.md,
        twenty-first round). ``copier`` (None: as set, at first ``LUCE_TUNE_FETCH_COPIER`` or ``"kernel"``): what
        copies the fetch, ``"kernel"`` that copy launch, ``"engine"`` the device's copy engine queued by a host
        thread (``engine.kernels.host_experts.HostBus``) that the select launch names the experts to, which takes
        no SM and reads pinned memory at the bus's full rate; the stage's expert launch waits for its copies
        (half-cold decode on one H100 host: as fast as the copy launch with one expert fetched, 237.4 against 238.1
        tok/s, and faster with two or three, where the launch's SMs cost more than its fetch saves:
        docs/benchmarks.md, twenty-third round). Only where experts are read from changes, never what is computed.
        Captured steps made before a change no longer match: the engine captures again."""
        warm = self.cold_warm if warm is None else warm
        for what, v, top in (("fetched", n, PREFETCH_MAX), ("warmed", warm, WARM_MAX)):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
                raise ConfigError(f"cold experts {what} ahead must be a whole number from 0 to {top}, got {v}")
        if ahead is not None and not isinstance(ahead, bool):
            raise ConfigError(f"cold_ahead must be true or false, got {ahead!r}")
        if route is not None and route not in AHEAD_ROUTES:
            raise ConfigError(f"the predicting router runs on one of {', '.join(AHEAD_ROUTES)}, got {route!r}")
        if programs is not None and (not isinstance(programs, int) or isinstance(programs, bool)
                                     or not 0 <= programs <= FETCH_PROGRAMS_MAX):
            raise ConfigError(f"the fetch's programs must be a whole number from 0 to {FETCH_PROGRAMS_MAX}, "
                              f"got {programs!r}")
        if copier is not None and copier not in FETCH_COPIERS:
            raise ConfigError(f"the fetch's copier is one of {', '.join(FETCH_COPIERS)}, got {copier!r}")
        self.cold_prefetch, self.cold_warm = n, warm
        if ahead is not None:
            self.cold_ahead = ahead
        if route is not None:
            self.ahead_route = route
        if programs is not None:
            self.fetch_programs = programs or None
        if copier is not None:
            self.fetch_copier = copier
        if n and self.fetch_copier == "engine" and self.cold_device == "gpu" and self.device.type == "cuda":
            for layer in self._layers:  # the copier starts now, not inside a step that a graph may be capturing
                if isinstance(layer.host, QuantizedExperts) and layer.host.blocks is not None:
                    self._bus(layer, self._stream_buffers(layer))
        self.placement_version += 1

    def set_budget(self, budget_mb: float, unit: str | None = None) -> Placement:
        """Re-place the experts for ``budget_mb`` in place (only experts that change tier move)
        and reset the counters; ``unit`` (None: as set) is what the hot set grows by."""
        placement = _checked_placement(self.stats, self.expert_bytes, budget_mb, self.min_hot, self.device,
                                       self.expert_vram_bytes, self.reserve, self.max_expert_mb,
                                       self.unit if unit is None else unit)
        self.unit = self.unit if unit is None else unit
        with torch.inference_mode(False):
            # layers that shrink go first, so their memory is free before others grow
            moves = sorted(zip(self._layers, placement.hot), key=lambda lh: len(lh[1]) - lh[0].n_hot)
            for layer, hot in moves:
                layer.place(hot)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.placement = placement
        self.placement_version += 1
        if self.cpu_share:
            self._assign_cpu_share()
        self.reset_counters()
        return placement

    def set_cpu_share(self, share: float, *, int8: bool | None = None, threads: int | None = None) -> None:
        """Hand ``share`` (0 to 1) of each layer's cold routed mass to CPU threads in decode-sized calls
        (``engine.kernels.host_experts``), the bus carrying the rest; 0 stops handing any. The staged path
        (``_staged_moe``) hands the threads that share of each call's cold pairs; the launches apart, the
        layer's CPU set of experts (``_assign_layer``). Needs
        ``cold_device="gpu"`` and Q4_0 or Q8_0 cold experts held as host blocks. The threads start with
        the first share above 0 (``threads`` of them, else one per core but one). ``int8`` (None: as set)
        picks 8-bit activations for the threads (ggml's Q8_0 rounding of the token rows and the inner
        activations, integer dot products: on the H200's host 3-4x fewer instructions a weight) or float32;
        a change restarts them. ``threads`` (None: as set) sets how many threads; a change restarts them too.
        Captured steps made before a change no longer match the executor: the engine captures again."""
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"the cold experts' CPU share must be between 0 and 1, got {share}")
        if share and self.cold_device != "gpu":
            raise ConfigError("a CPU share of the cold experts needs cold_device='gpu' (with cold_device='cpu' "
                              "CPU threads compute all of them already)")
        if threads is not None and threads < 1:
            raise ConfigError(f"the CPU share needs at least one thread, got {threads}")
        restart = int8 is not None and bool(int8) != self.cpu_int8
        restart |= threads is not None and (not self._threads_given or threads != self.threads)
        if int8 is not None:
            self.cpu_int8 = bool(int8)
        if threads is not None:
            self.threads, self._threads_given = threads, True
        if restart and self._host_share is not None:
            self._host_share.close()
            self._host_share = None
        if share and self._host_share is None:
            self._host_share = self._start_host_share()
        self.cpu_share = float(share)
        self._assign_cpu_share()
        self.placement_version += 1

    def _start_host_share(self) -> Any:
        from engine.kernels.host_experts import QTYPES, HostShare

        mats = []
        hidden = ffn = 0
        for i, layer in enumerate(self._layers):
            host = layer.host
            if not isinstance(host, QuantizedExperts) or host.blocks is None:
                raise ConfigError("a CPU share of the cold experts needs quantized experts held as host blocks "
                                  "(cold_format='quantized' with cold_device='gpu')")
            bad = [r.qtype.name for r in host.raw if r.qtype not in QTYPES]
            if bad:
                raise ConfigError(f"a CPU share of the cold experts computes Q4_0 and Q8_0 experts; layer {i} has "
                                  f"{', '.join(bad)}")
            mats.append([(b, r.qtype, r.rows, r.cols, lay) for b, r, lay in zip(host.blocks, host.raw, host.layouts)])
            hidden, ffn = host.raw[0].cols, max(ffn, host.raw[0].rows)
        threads = self.threads if self._threads_given else max(1, (os.cpu_count() or 2) - 1)
        return HostShare(mats, hidden=hidden, ffn=ffn, threads=threads, device=self.device, int8=self.cpu_int8)

    def _assign_cpu_share(self) -> None:
        """Each layer's CPU set: its cold experts in falling routed counts, taken while the set's mass
        stays within ``cpu_share`` of the layer's cold mass (uniform counts: that share of the experts)."""
        counts = self.stats.counts
        with torch.inference_mode(False):
            for i, layer in enumerate(self._layers):
                self._assign_layer(i, layer, counts)

    def _assign_layer(self, i: int, layer: _LayerTiers, counts: torch.Tensor) -> None:
        cold = [e for e in range(layer.n_expert) if not bool(layer.host_hot[e])]
        if not self.cpu_share or not cold:
            layer.assign_cpu(())
            return
        mass = counts[i, cold].double() + 1e-9
        order = sorted(range(len(cold)), key=lambda j: -float(mass[j]))
        total, taken, mine = float(mass.sum()), 0.0, []
        for j in order:  # hottest first, each taken while the set stays within the share (to half an expert)
            if taken + float(mass[j]) / 2 <= self.cpu_share * total:
                mine.append(cold[j])
                taken += float(mass[j])
        layer.assign_cpu(sorted(mine))

    @property
    def graph_safe(self) -> bool:
        """The Triton kernels in use and every expert hot, or the cold ones computed on the
        device: calls never wait for the host."""
        return self.impl == "triton" and (self.cold_device == "gpu"
                                          or all(layer.n_hot == layer.n_expert for layer in self._layers))

    @property
    def all_hot(self) -> bool:
        """Every expert of every layer in its device slot."""
        return all(layer.n_hot == layer.n_expert for layer in self._layers)

    def discount(self, layer_idx: int, pairs: torch.Tensor) -> None:
        """Take ``pairs`` (a device scalar) off the layer's pair counter: routes a caller made with id -1
        (padding, which no expert computes) and that ``__call__`` counted. All-hot placements only,
        where pairs are the hot hits (``stats_snapshot``)."""
        self._pairs[layer_idx].sub_(pairs)

    @property
    def expert_vram_bytes(self) -> int:
        return sum(layer.slot_bytes for layer in self._layers)

    @property
    def expert_host_bytes(self) -> int:
        """Host memory held by the master copies of every expert (the cold tier's store)."""
        return sum(layer.host.nbytes for layer in self._layers)

    def begin_layer(self, layer_idx: int, x: torch.Tensor) -> None:
        """At a layer's start (``x`` [T, H] the mixer's input): with ``cold_prefetch`` or ``cold_warm``, for a
        one-token call, predict the routing of the layer ``prefetch_target`` names (this one, or with
        ``cold_ahead`` the next one after an all-hot layer) from ``x`` (``set_predictors``), have the bus copy its
        first ``cold_prefetch`` cold experts into the stage's rows after ``STREAM_EXPERTS`` and name the next
        ``cold_warm`` to the CPU threads, on the second stream while this layer runs; the target layer's split
        waits for the prediction (not the copies) and serves their pairs from there (``_staged_moe``). A layer
        predicted at the layer before leaves its fetch be."""
        if self._fetch is not None and self._fetch[0] == layer_idx:
            return  # predicted at the layer before (``cold_ahead``)
        self._join_fetch()
        if (not (self.cold_prefetch or self.cold_warm) or self._predictors is None or not x.is_cuda or x.shape[0] != 1
                or not self.cpu_share or self._host_share is None or self.min_hot & (self.min_hot - 1)):
            return
        target = self.prefetch_target(layer_idx)
        if target is None:
            return
        predictors = self._predictors if target == layer_idx else self._ahead_predictors
        from engine.kernels.gather import gather_stacks
        from engine.kernels.hybrid_split import select_prefetch
        from engine.kernels.moe_gate import route_triton

        layer = self._layers[target]
        router = predictors[target]
        m, mw = self.cold_prefetch, self.cold_warm
        fetched = torch.empty(m, dtype=torch.int32, device=x.device) if m else None
        warmed = torch.empty(mw, dtype=torch.int32, device=x.device) if mw else None
        buffers = self._stream_buffers(layer)
        sources = tuple(t.raw if isinstance(t, QuantExperts) else t for t in layer.mapped)
        bus = self._bus(layer, buffers) if m and self.fetch_copier == "engine" else None
        main, side = torch.cuda.current_stream(x.device), self._side_stream(x.device)
        on_main = self.ahead_route == "main"
        if on_main:  # a few microseconds of the whole device before the layer's own kernels
            ids, _ = route_triton(x, router, self.min_hot, ahead=True)
        side.wait_stream(main)
        picked = torch.cuda.Event()
        with torch.cuda.stream(side):
            if not on_main:
                ids, _ = route_triton(x, router, self.min_hot, side=True)
            select_prefetch(ids.view(-1), layer.slot_of, fetched, self._fetch_sent[target:target + 1],
                            warmed=warmed, share=self._host_share, layer=target, bus=bus)
            picked.record(side)
            if m and bus is None:
                gather_stacks(sources, tuple(b[STREAM_EXPERTS:STREAM_EXPERTS + m] for b in buffers), fetched,
                              programs=self.fetch_programs)
        for t in (x, fetched, warmed, ids):  # read there: their blocks are not handed out again before it is done
            if t is not None:
                t.record_stream(side)
        self._fetch = (target, fetched, warmed, picked, bus)

    def prefetch_target(self, layer_idx: int) -> int | None:
        """The layer whose cold experts are fetched and warmed at ``layer_idx``'s start, or None: the next layer
        with ``cold_ahead`` where this one's experts are all hot and the next one's last one-token call took
        the staged path's two streams; else this layer where its own did."""
        nxt = layer_idx + 1
        if (self.cold_ahead and nxt < len(self._layers) and self._two_streams[nxt]
                and self._layers[layer_idx].n_hot == self._layers[layer_idx].n_expert):
            return nxt
        return layer_idx if self._two_streams[layer_idx] else None

    def _join_fetch(self) -> None:
        """A fetch ahead that its layer's experts did not take (the call went another path): the compute
        stream waits for the second stream (and that for the copier's copies), so no copy outlives its step or a
        graph's capture."""
        if self._fetch is not None:
            device, bus = self.device, self._fetch[4]
            side = self._side_stream(device)
            if bus is not None:
                from engine.kernels.host_share_triton import bus_wait

                with torch.cuda.stream(side):
                    bus_wait(bus)
            torch.cuda.current_stream(device).wait_stream(side)
            self._fetch = None

    def _bus(self, layer: _LayerTiers, buffers: tuple[torch.Tensor, ...]) -> Any:
        """The copier filling ``buffers``' rows after ``STREAM_EXPERTS`` from the host blocks of every layer of
        ``layer``'s layout (``HostBus``), started on first use."""
        key = (layer.host.dtype, layer.host.expert_shapes)
        if key not in self._buses:
            from engine.kernels.host_experts import HostBus

            if torch.cuda.is_current_stream_capturing():
                raise ConfigError("the copy engine's copier must start before a CUDA graph's capture "
                                  "(set_cold_prefetch starts it)")
            if not isinstance(layer.host, QuantizedExperts) or layer.host.blocks is None:
                raise ConfigError("the copy engine's fetch needs quantized experts held as host blocks "
                                  "(cold_format='quantized' with cold_device='gpu')")
            same = [lt.host.blocks if (isinstance(lt.host, QuantizedExperts) and lt.host.blocks is not None
                                       and (lt.host.dtype, lt.host.expert_shapes) == key) else None
                    for lt in self._layers]
            self._buses[key] = HostBus(same, tuple(b[STREAM_EXPERTS:] for b in buffers), device=self.device)
        return self._buses[key]

    def moe_with_shared(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
                        shared: "SharedExpertWeights") -> torch.Tensor | None:
        """The layer's routed experts and its shared expert in the same two launches (the shared
        expert as one more pair per token), ``routed + sigmoid(x . gate_inp) * shared`` in x's
        dtype; None where that does not apply, and the caller computes them apart. It applies to
        decode-sized calls (up to ``gemv_max_m`` tokens) through the Triton kernels, with every
        expert of the layer hot in quantized slots and a quantized shared expert of one routed
        expert's block type, layout and shape (``shared_fits``). ``LUCE_TUNE_SHARED_IN_MOE=0``
        switches it off. Saves the shared expert's four launches per layer."""
        layer = self._layers[layer_idx]
        if layer.n_hot != layer.n_expert:
            out = self._staged_moe(layer_idx, x, topk_ids, topk_w, shared)
            self._join_fetch()
            return out
        if (self.impl != "triton" or not layer.n_hot
                or os.environ.get(SHARED_IN_MOE_ENV, "1") == "0"
                or not isinstance(layer.slot_experts[0], QuantExperts)
                or not isinstance(shared.gate_up, QuantMatrix) or not isinstance(shared.down, QuantMatrix)):
            return None
        from engine.kernels.quant.triton import QuantKernelConfig, quantized_moe_triton, shared_fits

        gate, up, down = layer.slot_experts
        if x.shape[0] > QuantKernelConfig().gemv_max_m or not shared_fits(gate, down, shared.gate_up, shared.down):
            return None
        self._host_pairs[layer_idx] += topk_ids.numel()
        return quantized_moe_triton(x, gate, up, down, topk_ids, topk_w,
                                    shared=(shared.gate_up, shared.down, shared.gate_inp))

    def _staged_moe(self, layer_idx: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                    shared: "SharedExpertWeights") -> torch.Tensor | None:
        """A layer with cold experts in a decode-sized call with ``cold_device="gpu"`` (CUDA, or the
        interpreter's tests), in a handful of launches: the pairs split between the device slots, the bus and
        the CPU threads (and the threads' job published: ``engine.kernels.hybrid_split``), the bus's experts
        copied into the stage stacks (``gather_stacks``), the experts' launches over slots and stage with the
        shared expert riding along, and the sums (with a CPU share, the threads' too) added by one launch
        (``collect_into``). With a CPU share (CUDA) the copies and the stage's expert launches run on a second
        stream while the slots' run on this one (``LUCE_TUNE_HYBRID_OVERLAP=0``, and without threads: one
        stream, one pair of expert launches over slots and stage together). None where it does not apply
        (then ``__call__`` and the caller's shared expert: about 30 launches a layer);
        ``LUCE_TUNE_HYBRID_STAGED=0`` switches it off."""
        layer = self._layers[layer_idx]
        T, k = ids.shape
        fetch = self._fetch if self._fetch is not None and self._fetch[0] == layer_idx else None
        if T == 1:
            self._two_streams[layer_idx] = False  # until this call takes them
        if (self.impl != "triton" or self.cold_device != "gpu" or not (x.is_cuda or COLD_GATHER) or not layer.n_hot
                or os.environ.get(STAGED_ENV, "1") == "0" or os.environ.get(SHARED_IN_MOE_ENV, "1") == "0"
                or T * k > STREAM_EXPERTS or os.environ.get(COLD_GATHER_ENV, "1") == "0" or COLD_GATHER is False
                or not isinstance(layer.slot_experts[0], QuantExperts)
                or not isinstance(shared.gate_up, QuantMatrix) or not isinstance(shared.down, QuantMatrix)):
            return None
        from engine.kernels.gather import gather_stacks
        from engine.kernels.host_share_triton import bus_wait, collect_into
        from engine.kernels.hybrid_split import split_pairs
        from engine.kernels.quant.triton import QuantKernelConfig, quantized_moe_triton, shared_fits
        from engine.kernels.quant.words import stage_fits

        gate, up, down = layer.slot_experts
        if T > QuantKernelConfig().gemv_max_m or not shared_fits(gate, down, shared.gate_up, shared.down):
            return None
        buffers = self._stream_buffers(layer)
        sources = tuple(m.raw if isinstance(m, QuantExperts) else m for m in layer.mapped)
        if any(src.dtype != b.dtype or src.shape[1:] != b.shape[1:] for src, b in zip(sources, buffers)):
            return None
        rows = STREAM_EXPERTS + PREFETCH_MAX if fetch is not None and fetch[1] is not None else T * k  # rows read
        stage = layer.host.as_experts(tuple(b[:rows] for b in buffers))
        if not all(isinstance(st, QuantExperts) and stage_fits(sl, st) for sl, st in zip(layer.slot_experts, stage)):
            return None
        pool = self._host_share if self.cpu_share and self._host_share is not None and x.is_cuda else None
        pool = pool if pool is not None and pool.fits(T, k) else None
        self._host_pairs[layer_idx] += ids.numel()
        codes = torch.empty((T, k), dtype=torch.int32, device=x.device)
        stage_ids = torch.empty(T * k, dtype=torch.int32, device=x.device)
        stacks = tuple(b[:T * k] for b in buffers)
        args = (shared.gate_up, shared.down, shared.gate_inp)
        if pool is not None and os.environ.get(OVERLAP_ENV, "1") != "0":
            # the bus's copies and their experts on a second stream while the hot pairs and the shared
            # expert run on this one (a graph captures the fork and the join); with no threads to wait
            # for, one stream measured faster (docs/benchmarks.md, 2026-12-04 fourth round)
            stage_codes = torch.empty((T, k), dtype=torch.int32, device=x.device)
            main, side = torch.cuda.current_stream(x.device), self._side_stream(x.device)
            fetched = {}
            bus = None
            if fetch is not None:  # the bus's copies fetched ahead (their pairs read those rows), the threads' warmed
                _, ahead, warm, picked, bus = fetch
                main.wait_event(picked)
                fetched = dict(fetched=ahead, fetched_row=STREAM_EXPERTS, warmed=warm,
                               fetched_hits=self._fetch_hits[layer_idx:layer_idx + 1])
                self._fetch = None  # joined below with the second stream
            split_pairs(ids, layer.slot_of, self._hot_hits[layer_idx:layer_idx + 1], codes, stage_ids, share=pool,
                        fraction=self.cpu_share, layer=layer_idx, x=x, w=w, stage_codes=stage_codes, **fetched)
            self._two_streams[layer_idx] = T == 1
            side.wait_stream(main)
            with torch.cuda.stream(side):
                gather_stacks(sources, stacks, stage_ids)
                if bus is not None:  # the copier's copies landed before the stage's launch reads their rows
                    bus_wait(bus)
                staged = quantized_moe_triton(x, gate, up, down, stage_codes, w, stage=tuple(stage),
                                              out_dtype=torch.float32)
            hot = quantized_moe_triton(x, gate, up, down, codes, w, shared=args, out_dtype=torch.float32)
            main.wait_stream(side)
            dst = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            collect_into(pool, hot, dst, staged)
            return dst
        split_pairs(ids, layer.slot_of, self._hot_hits[layer_idx:layer_idx + 1], codes, stage_ids, share=pool,
                    fraction=self.cpu_share, layer=layer_idx, x=x, w=w)
        gather_stacks(sources, stacks, stage_ids)
        out = quantized_moe_triton(x, gate, up, down, codes, w, shared=args, stage=tuple(stage),
                                   out_dtype=torch.float32 if pool is not None else None)
        if pool is None:
            return out
        dst = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        collect_into(pool, out, dst)
        return dst

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_w: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids [T, k] int64, topk_w [T, k] float32 -> [T, H] in x's dtype."""
        layer = self._layers[layer_idx]
        self._host_pairs[layer_idx] += topk_ids.numel()
        if layer.n_hot == layer.n_expert:  # slot e holds expert e; every pair is a hot hit (stats_snapshot)
            return layer.hot_moe(x, topk_ids, topk_w, self.impl, self.kernel_config)
        slots = layer.slot_of[topk_ids]  # [T, k], -1 where the expert is cold
        self._hot_hits[layer_idx].add_((slots >= 0).sum())
        if self.cold_device == "gpu":
            share = self._host_share if layer.n_mine and self._host_share is not None else None
            if share is not None and not share.fits(*topk_ids.shape):
                share = None
            if share is not None:  # the threads start on their pairs while the device computes the others
                share.publish(layer_idx, x, topk_ids, topk_w, layer.mine)
            out = self._cold_on_device(layer, x, topk_ids, topk_w,
                                       layer.bus_cold_of if share is not None else layer.cold_of).float()
            if layer.n_hot:
                out += layer.hot_moe(x, slots, topk_w, self.impl, self.kernel_config).float()
            if share is not None:
                share.collect(out)
            return out.to(x.dtype)

        host = torch.device("cpu")
        on_cpu = x.device == host
        x_h, ids_h, w_h = (t if on_cpu else _to_pinned(t) for t in (x, topk_ids, topk_w))
        copied = None
        if not on_cpu:
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(x.device))
        hot = None
        if layer.n_hot:  # queued on the device before the host waits for its copies
            hot = layer.hot_moe(x, slots, topk_w, self.impl, self.kernel_config)
        if copied is not None:
            copied.synchronize()
        cold = self._cold(layer, x_h, ids_h, w_h, pin=not on_cpu)
        cold = cold.to(x.device, non_blocking=True)
        if hot is not None:
            cold += hot
        return cold.to(x.dtype)

    def _cold_on_device(self, layer: _LayerTiers, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                        cold_of: torch.Tensor) -> torch.Tensor:
        """The output [T, H] of the cold experts that ``cold_of`` maps (-1: not these) computed by the device
        from host memory: read in place for short calls, copied to the device in runs of experts for long ones."""
        cold_ids = cold_of[ids]  # [T, k], -1 where the expert is hot (or the CPU threads'
        host, T, k = layer.host, *ids.shape
        if T * k <= layer.n_expert:
            gathered = self._gathered(layer, cold_ids)
            if gathered is not None:
                return host.moe(x, gathered, torch.where(cold_ids >= 0, self._pair_index(T, k), -1), w, self.impl,
                                self.kernel_config)
            return host.moe(x, layer.mapped, cold_ids, w, self.impl, self.kernel_config)
        buffers = self._stream_buffers(layer)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for first, n in layer.cold_runs:
            host.upload(buffers, 0, first, n)
            in_run = (cold_ids >= first) & (cold_ids < first + n)
            run_ids = torch.where(in_run, cold_ids - first, -1)
            out += host.moe(x, host.as_experts(tuple(b[:n] for b in buffers)), run_ids, w, self.impl,
                            self.kernel_config).float()
        return out

    def _gathered(self, layer: _LayerTiers, cold_ids: torch.Tensor) -> tuple[Any, ...] | None:
        """The routed cold experts copied into the stream buffers, pair ``p``'s expert at row ``p``, as the
        expert launches take them; None where this does not apply (more pairs than the buffers hold, the
        Triton kernels off, the device slots in another form than the host copies, or
        ``LUCE_TUNE_COLD_GATHER=0``): the caller then reads the experts in place."""
        on = (cold_ids.is_cuda and os.environ.get(COLD_GATHER_ENV, "1") != "0") if COLD_GATHER is None else COLD_GATHER
        if not on or cold_ids.numel() > STREAM_EXPERTS or self.impl != "triton":
            return None
        buffers = self._stream_buffers(layer)
        sources = tuple(m.raw if isinstance(m, QuantExperts) else m for m in layer.mapped)
        if any(s.dtype != b.dtype or s.shape[1:] != b.shape[1:] for s, b in zip(sources, buffers)):
            return None
        from engine.kernels.gather import gather_experts

        flat = cold_ids.reshape(-1)
        for src, buf in zip(sources, buffers):
            gather_experts(src, buf, flat)
        return layer.host.as_experts(tuple(b[:flat.numel()] for b in buffers))

    def _pair_index(self, T: int, k: int) -> torch.Tensor:
        """[T, k]: each pair's row in the gathered buffers (a constant of the shape, made once)."""
        key = (T, k)
        if key not in self._pair_rows:
            with torch.inference_mode(False):
                self._pair_rows[key] = torch.arange(T * k, device=self.device).view(T, k)
        return self._pair_rows[key]

    def _stream_buffers(self, layer: _LayerTiers) -> tuple[torch.Tensor, ...]:
        """Device buffers for ``STREAM_EXPERTS`` experts of ``layer``'s layout, shared by the layers."""
        key = (layer.host.dtype, layer.host.expert_shapes)
        if key not in self._stream_buffers_by_layout:
            self._stream_buffers_by_layout[key] = tuple(  # then the rows of the experts fetched ahead
                torch.empty((STREAM_EXPERTS + PREFETCH_MAX, *shape), dtype=layer.host.dtype, device=self.device)
                for shape in layer.host.expert_shapes)
        return self._stream_buffers_by_layout[key]

    def _cold(self, layer: _LayerTiers, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, pin: bool) -> torch.Tensor:
        """Float32 [T, H] contribution of the cold experts, computed by the thread pool."""
        cold_ids = torch.where(layer.host_hot[ids], -1, ids)
        experts = routed_experts(cold_ids)
        out = torch.zeros(x.shape, dtype=torch.float32, pin_memory=pin)
        chunks = [experts[i::self.threads] for i in range(min(self.threads, len(experts)))]
        futures = [self._pool.submit(layer.host.experts_sum, x, cold_ids, w, chunk) for chunk in chunks]
        for f in futures:
            out += f.result()
        return out

    def stats_snapshot(self) -> HybridStats:
        """Counters since the last reset (reads the device counters: one host synchronisation)."""
        self.check_cpu_share()
        placement = self.placement
        all_hot = torch.tensor([layer.n_hot == layer.n_expert for layer in self._layers], device=self.device)
        pairs_of = self._pairs + torch.tensor(self._host_pairs, dtype=torch.int64, device=self.device)
        hot = torch.where(all_hot, pairs_of, self._hot_hits)  # all-hot layers count pairs only
        hot_hits, pairs, sent, served = torch.stack([hot.sum(), pairs_of.sum(), self._fetch_sent.sum(),
                                                     self._fetch_hits.sum()]).tolist()
        return HybridStats(
            budget_mb=placement.budget_mb, hot_experts=placement.hot_count, cold_experts=placement.cold_count,
            hot_hits=hot_hits, cold_hits=pairs - hot_hits,
            expected_cold_hit_rate=placement.expected_cold_hit_rate, expert_vram_mb=self.expert_vram_bytes / MB,
            expert_host_mb=self.expert_host_bytes / MB, cold_cpu_share=self.cpu_share,
            cold_prefetch=self.cold_prefetch, cold_warm=self.cold_warm, prefetched=sent, prefetch_served=served)

    def reset_counters(self) -> None:
        self._hot_hits.zero_()
        self._fetch_hits.zero_()
        self._fetch_sent.zero_()
        self._pairs.zero_()
        self._host_pairs = [0] * len(self._layers)

    def host_counts(self) -> list[int]:
        """The pairs counted on the host so far, per layer (a copy)."""
        return list(self._host_pairs)

    def add_host_counts(self, delta: Sequence[int]) -> None:
        """Add ``delta`` (per layer) to the host's pair counts: a captured step's replay, whose Python
        does not run, adds what one run of it counted."""
        if len(delta) != len(self._host_pairs):
            raise ValueError(f"{len(delta)} counts for {len(self._host_pairs)} layers")
        self._host_pairs = [a + b for a, b in zip(self._host_pairs, delta)]

    def stall_report(self, seconds: float) -> str | None:
        """``host_experts.stall_report`` over this executor's CPU threads and copiers."""
        if self._host_share is None and not self._buses:
            return None
        from engine.kernels.host_experts import stall_report

        return stall_report(self._host_share, list(self._buses.values()), seconds)

    def check_cpu_share(self) -> None:
        """Raise where the CPU share or the copier failed a call (reads host memory: no device synchronisation)."""
        if self._host_share is not None:
            self._host_share.check()
        for bus in self._buses.values():
            bus.check()

    def close(self) -> None:
        """Stop the CPU threads and close the GGUF file, if any (the executor cannot run afterwards)."""
        self._pool.shutdown(wait=True)
        if self._host_share is not None:
            self._host_share.close()
            self._host_share = None
        for bus in self._buses.values():
            bus.close()
        self._buses.clear()
        if self._gguf_file is not None:
            self._gguf_file.close()


COLD_CPU_SHARE_ENV = "LUCE_TUNE_COLD_CPU_SHARE"
COLD_CPU_INT8_ENV = "LUCE_TUNE_COLD_CPU_INT8"  # 0: the CPU share multiplies in float32
PLACEMENT_UNIT_ENV = "LUCE_TUNE_PLACEMENT_UNIT"  # expert, layer or alternate: what the hot set grows by
COLD_PREFETCH_ENV = "LUCE_TUNE_COLD_PREFETCH"  # cold experts fetched ahead a layer (``set_cold_prefetch``)
COLD_WARM_ENV = "LUCE_TUNE_COLD_WARM"  # cold experts the CPU threads warm ahead a layer (``set_cold_prefetch``)
COLD_AHEAD_ENV = "LUCE_TUNE_COLD_AHEAD"  # 0: a cold layer's prefetch always waits for its own start
AHEAD_ROUTE_ENV = "LUCE_TUNE_AHEAD_ROUTE"  # where the predicting router runs (``set_cold_prefetch(route=)``)
AHEAD_ROUTES = ("main", "side")  # the first is the default (docs/benchmarks.md, twentieth round)
FETCH_PROGRAMS_ENV = "LUCE_TUNE_FETCH_PROGRAMS"  # programs of the bus's fetch ahead (``set_cold_prefetch(programs=)``)
FETCH_PROGRAMS_MAX = 1024
FETCH_PROGRAMS_DEFAULT = 8  # the fastest bound measured (2, 4, 8, 32 and one a block: twenty-first round)
FETCH_COPIER_ENV = "LUCE_TUNE_FETCH_COPIER"  # what copies the fetch ahead (``set_cold_prefetch(copier=)``)
FETCH_COPIERS = ("kernel", "engine")  # the first is the default


def _env_flag(name: str) -> bool:
    """A setting of 0 or 1 that is on when unset."""
    text = os.environ.get(name, "1").strip()
    if text not in ("0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


def _env_choice(name: str, choices: Sequence[str]) -> str:
    """A setting among ``choices``, the first when unset."""
    text = os.environ.get(name, "").strip() or choices[0]
    if text not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {text!r}")
    return text


def _env_share() -> float:
    text = os.environ.get(COLD_CPU_SHARE_ENV, "").strip()
    if not text:
        return 0.0
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{COLD_CPU_SHARE_ENV} must be a number between 0 and 1, got {text!r}") from None


def _env_prefetch(name: str, top: int = PREFETCH_MAX) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) > top:
        raise ConfigError(f"{name} must be a whole number from 0 to {top}, got {text!r}")
    return int(text)


def _env_programs() -> int:
    if not os.environ.get(FETCH_PROGRAMS_ENV, "").strip():
        return FETCH_PROGRAMS_DEFAULT
    return _env_prefetch(FETCH_PROGRAMS_ENV, FETCH_PROGRAMS_MAX)


def _env_unit() -> str:
    return _env_choice(PLACEMENT_UNIT_ENV, PLACEMENT_UNITS)


def _checked_placement(stats: RoutingStats, expert_bytes: Sequence[int], budget_mb: float, min_hot: int,
                       device: torch.device, reclaimable_bytes: int, reserve: GpuReserve,
                       max_expert_mb: float | None, unit: str = "expert") -> Placement:
    placement = plan_placement(stats, expert_bytes, budget_mb, min_hot, unit)
    capacity = gpu_expert_capacity_mb(device, reclaimable_bytes, reserve)
    if max_expert_mb is not None:
        capacity = max_expert_mb if capacity is None else min(capacity, max_expert_mb)
    check_fits(placement, capacity, device, reserve)
    return placement


def attach_hybrid(model: Any, budget_mb: float, stats: RoutingStats | None = None, **options: Any) -> HybridExperts:
    """Engine glue: place ``model``'s experts for ``budget_mb`` and make it run them hybrid."""
    hybrid = HybridExperts.from_model(model, budget_mb, stats, **options)
    model.set_expert_executor(hybrid)
    return hybrid


def _cold_runs(hot: Sequence[bool]) -> list[tuple[int, int]]:
    """(first expert, count) of consecutive cold experts, at most ``STREAM_EXPERTS`` in each."""
    runs: list[tuple[int, int]] = []
    for e, is_hot in enumerate(hot):
        if is_hot:
            continue
        if runs and sum(runs[-1]) == e and runs[-1][1] < STREAM_EXPERTS:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((e, 1))
    return runs


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(dst, src) index pairs, ascending in both -> (dst start, src start, length) of consecutive runs."""
    runs: list[list[int]] = []
    for dst, src in pairs:
        if runs and runs[-1][0] + runs[-1][2] == dst and runs[-1][1] + runs[-1][2] == src:
            runs[-1][2] += 1
        else:
            runs.append([dst, src, 1])
    return [(a, b, n) for a, b, n in runs]


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    if t.device.type == "cpu":
        return t.contiguous().pin_memory() if pin else t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    out.copy_(t)
    return out


def _host_blocks(raw: "RawExpertMatrix", pin: bool, layout: str = "ggml") -> torch.Tensor:
    """A raw expert stack copied out of the file into (pinned) host memory, uint8 [E, rows,
    row_bytes], its rows in ``layout`` (rearranged as they are copied, one expert at a time)."""
    n_expert, rb = raw.data.shape[0], row_bytes(raw.qtype, raw.cols)
    out = torch.empty((n_expert, raw.rows, rb), dtype=torch.uint8, pin_memory=pin)
    if layout == "ggml":
        out.view(n_expert, -1).numpy()[:] = raw.data
        return out
    _, size = GGML_QUANT_SIZES[raw.qtype]
    codes = raw.cols // 32 * (size - 2)
    dst = out.numpy()
    for e in range(n_expert):
        blocks = raw.data[e].reshape(raw.rows, -1, size)
        dst[e, :, :codes] = blocks[:, :, 2:].reshape(raw.rows, -1)
        dst[e, :, codes:] = blocks[:, :, :2].reshape(raw.rows, -1)
    return out


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
