"""The DFlash draft model: a few Qwen3-style layers that propose a whole block at once.

The draft has no embedding or LM head of its own: it reads the target's. Its context is the
concatenation of the target's residual-stream outputs at ``target_layer_ids``, projected by
``fc`` and normed by ``hidden_norm``; in every layer those context rows supply keys and values
beside the block's own, and the block's queries attend to both. Inside the block attention is
non-causal (each slot sees every other slot).

Inference keeps the projected context keys/values of each layer in a ``DraftCache`` (they
depend only on the context rows, never on the block), so one draft step costs only the
``block_size`` query tokens plus the context rows committed since the last step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import apply_rope, norm_rope, rope_cos_sin, sdpa, static_attention, write_kv
from engine.model.norm import add_rms_norm, rms_norm
from engine.model.linear import linear
from engine.model.moe import swiglu


def default_layer_ids(n_target_layers: int, n_features: int) -> tuple[int, ...]:
    """Evenly spaced capture layers: ``round(1 + i * (n_target - 4) / (n_features - 1))``.

    Clamped to the target's depth so that small targets (tests) still get valid ids.
    """
    if n_target_layers < 1 or n_features < 1:
        raise ValueError(f"need a positive target depth and feature count, got {n_target_layers}, {n_features}")
    if n_features == 1:
        return (n_target_layers // 2,)
    span = max(n_target_layers - 4, 0)
    return tuple(min(round(1 + i * span / (n_features - 1)), n_target_layers - 1) for i in range(n_features))


@dataclass(frozen=True)
class DraftConfig:
    n_layers: int
    hidden: int
    ffn: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    vocab: int = 0  # the vocabulary it was trained with; 0 when the file does not say
    rope_dim: int = 0  # rotated dims per head; 0 means all of them (set to head_dim)
    context_length: int = 32768
    sliding_window: int = 0  # 0: every layer attends to the whole context
    swa_layers: tuple[bool, ...] = ()  # which layers use the window (all when empty and window > 0)
    causal: bool = False  # causal attention inside the block (some published drafts)

    def __post_init__(self) -> None:
        positive = {"n_layers": self.n_layers, "hidden": self.hidden, "ffn": self.ffn, "n_head": self.n_head,
                    "n_head_kv": self.n_head_kv, "head_dim": self.head_dim, "context_length": self.context_length}
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"draft {name} must be positive, got {value}")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"draft n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.block_size < 2:
            raise ValueError(f"draft block_size must be at least 2, got {self.block_size}")
        if self.mask_token_id < 0 or (self.vocab and self.mask_token_id >= self.vocab):
            raise ValueError(f"draft mask_token_id {self.mask_token_id} is outside the vocabulary of {self.vocab}")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(f"draft target_layer_ids must be non-negative layer ids, got {list(self.target_layer_ids)}")
        if self.rope_dim == 0:
            object.__setattr__(self, "rope_dim", self.head_dim)
        if self.rope_dim < 0 or self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ValueError(f"draft rope_dim {self.rope_dim} must be even and at most head_dim {self.head_dim}")
        if self.sliding_window < 0:
            raise ValueError(f"draft sliding_window must be >= 0, got {self.sliding_window}")
        if self.swa_layers and len(self.swa_layers) != self.n_layers:
            raise ValueError(f"draft swa_layers has {len(self.swa_layers)} entries for {self.n_layers} layers")

    @property
    def n_features(self) -> int:
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` in tokens, 0 for none."""
        if not self.sliding_window:
            return 0
        return self.sliding_window if (not self.swa_layers or self.swa_layers[layer]) else 0


class DraftLayer(nn.Module):
    """Weights of one draft layer, torch ``[out, in]``; norms are plain multipliers."""

    def __init__(self, cfg: DraftConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim

        def matrix(rows: int, cols: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(rows, cols, device=device, dtype=dtype))

        def norm(n: int) -> nn.Parameter:
            return nn.Parameter(torch.ones(n, device=device, dtype=torch.float32))

        self.attn_norm = norm(cfg.hidden)
        self.q = matrix(q_dim, cfg.hidden)
        self.k = matrix(kv_dim, cfg.hidden)
        self.v = matrix(kv_dim, cfg.hidden)
        self.o = matrix(cfg.hidden, q_dim)
        self.q_norm = norm(cfg.head_dim)
        self.k_norm = norm(cfg.head_dim)
        self.ffn_norm = norm(cfg.hidden)
        self.gate = matrix(cfg.ffn, cfg.hidden)
        self.up = matrix(cfg.ffn, cfg.hidden)
        self.down = matrix(cfg.hidden, cfg.ffn)


class DFlashDraft(nn.Module):
    """The draft network. Tokens enter as the target's embeddings; hidden states leave normed,
    ready for the target's output matrix."""

    def __init__(self, cfg: DraftConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Parameter(torch.empty(cfg.hidden, cfg.n_features * cfg.hidden, device=device, dtype=dtype))
        self.hidden_norm = nn.Parameter(torch.ones(cfg.hidden, device=device, dtype=torch.float32))
        self.layers = nn.ModuleList(DraftLayer(cfg, device=device, dtype=dtype) for _ in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden, device=device, dtype=torch.float32))

    @property
    def device(self) -> torch.device:
        return self.fc.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype

    def init_random(self, generator: torch.Generator | None = None, std: float = 0.02) -> "DFlashDraft":
        """Normal(0, std) matrices, unit norms: the starting point of training (and of tests)."""
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p))
                    p.mul_(std)
                else:
                    p.fill_(1.0)
        return self

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.cfg.rope_dim, self.cfg.rope_theta)

    def project_context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values the context rows give every layer.

        features [..., C, n_features * hidden] (the target's captured layers, concatenated in
        ``target_layer_ids`` order), positions [..., C] -> per layer (k, v) [..., n_head_kv, C, head_dim].
        """
        cfg = self.cfg
        lead = features.shape[:-1]  # [..., C]
        ctx = rms_norm(linear(features.to(self.dtype), self.fc), self.hidden_norm, cfg.rms_eps)
        ctx = ctx.reshape(-1, cfg.hidden)
        cos, sin = self._rope(positions.reshape(-1))
        out = []
        for layer in self.layers:
            k = linear(ctx, layer.k).view(-1, cfg.n_head_kv, cfg.head_dim)
            v = linear(ctx, layer.v).view(-1, cfg.n_head_kv, cfg.head_dim)
            k = apply_rope(rms_norm(k, layer.k_norm, cfg.rms_eps), cos, sin)
            shape = (*lead, cfg.n_head_kv, cfg.head_dim)
            out.append((k.view(shape).transpose(-3, -2), v.view(shape).transpose(-3, -2)))
        return out

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, cache: "DraftCache", slots: torch.Tensor,
                      fused: "FusedDraftWeights") -> None:
        """``project_context`` of rows features [C, n_features * hidden] at ``positions`` [C], written into
        ``cache`` at ``slots`` [C] (positions too) without counting them in: each layer's keys and values in
        one merged product and one norm + RoPE + cache write launch where it applies (a fixed-shape
        extension's per-layer launches: two rather than some eight)."""
        cfg = self.cfg
        ctx = rms_norm(linear(features.to(self.dtype), self.fc), self.hidden_norm, cfg.rms_eps)
        rope = self._rope(positions)
        C, Hkv, D = ctx.shape[0], cfg.n_head_kv, cfg.head_dim
        for i, layer in enumerate(self.layers):
            k, v = linear(ctx, fused.kv[i]).split([Hkv * D, Hkv * D], dim=-1)
            write_kv(k.view(C, Hkv, D), v.view(C, Hkv, D), layer.k_norm, rope, cache.k[i], cache.v[i], slots,
                     cfg.rms_eps)
        cache.positions.index_copy_(0, slots, positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                context: list[tuple[torch.Tensor, torch.Tensor]], context_positions: torch.Tensor,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] block embeddings at ``positions`` [T] -> normed hidden [T, hidden].

        ``context`` holds each layer's context keys/values [n_head_kv, C, head_dim] at
        ``context_positions`` [C]. ``visible`` [T, C + T] (bool) further restricts which keys
        each query sees (training packs many blocks into one call); ``None`` lets every block
        slot see all context and all of its block. Every argument may carry a leading batch
        dimension R of independent rows (x [R, T, hidden], positions [R, T], context
        [R, n_head_kv, C, head_dim], context_positions [R, C], visible [R, T, C + T]).
        """
        if x.dim() == 2:
            context = [(k[None], v[None]) for k, v in context]
            out = self.forward(x[None], positions[None], context, context_positions[None],
                               None if visible is None else visible[None])
            return out[0]
        cfg = self.cfg
        R, T = x.shape[:2]
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        cos, sin = self._rope(positions.reshape(-1))
        key_positions = torch.cat([context_positions, positions], dim=-1)  # [R, C + T]
        h = x.to(self.dtype).reshape(R * T, cfg.hidden)
        for i, layer in enumerate(self.layers):
            mask = _visibility(positions, key_positions, causal=cfg.causal, window=cfg.window(i), extra=visible)
            a = rms_norm(h, layer.attn_norm, cfg.rms_eps)
            q = linear(a, layer.q).view(R * T, H, D)
            k = linear(a, layer.k).view(R * T, Hkv, D)
            v = linear(a, layer.v).view(R * T, Hkv, D)
            q = apply_rope(rms_norm(q, layer.q_norm, cfg.rms_eps), cos, sin).view(R, T, H, D).transpose(1, 2)
            k = apply_rope(rms_norm(k, layer.k_norm, cfg.rms_eps), cos, sin).view(R, T, Hkv, D).transpose(1, 2)
            ck, cv = context[i]
            keys = torch.cat([ck, k], dim=2)  # [R, Hkv, C + T, D]
            values = torch.cat([cv, v.view(R, T, Hkv, D).transpose(1, 2)], dim=2)
            gqa = H != Hkv
            if gqa and visible is not None:
                # masked GQA has no fused SDPA kernel: the math one would hold every score of the
                # many packed training queries in float32; whole heads keep the memory-efficient
                # kernel (a decode step's few queries are cheaper without the copy)
                keys, values = keys.repeat_interleave(H // Hkv, dim=1), values.repeat_interleave(H // Hkv, dim=1)
                gqa = False
            att = sdpa(q, keys, values, attn_mask=None if mask is None else mask[:, None],
                       enable_gqa=gqa)  # [R, H, T, D]
            h = h + linear(att.transpose(1, 2).reshape(R * T, H * D), layer.o)
            m = rms_norm(h, layer.ffn_norm, cfg.rms_eps)
            h = h + linear(F.silu(linear(m, layer.gate)) * linear(m, layer.up), layer.down)
        return rms_norm(h, self.norm, cfg.rms_eps).view(R, T, cfg.hidden)

    def forward_in_cache(self, x: torch.Tensor, positions: torch.Tensor, cache: "DraftCache", slots: torch.Tensor,
                         visible: torch.Tensor, fused: "FusedDraftWeights") -> torch.Tensor:
        """``forward`` of one block of a full-attention, non-causal draft, with its keys and values
        written into ``cache`` at ``slots`` [T] (the rows just past the context, which the next
        extension overwrites) and the queries attending over the cache's buffers under ``visible``
        [T, max_len] (the context rows and the block's own). No concatenation, no mask per layer:
        the engine's fused norm, norm + RoPE (with the cache writes) and split-key attention kernels
        and SwiGLU where they apply, the projections merged in ``fused``. x [T, hidden] -> normed hidden
        [T, hidden].
        """
        cfg = self.cfg
        T = x.shape[0]
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        cos, sin = self._rope(positions)
        h, r = x.to(self.dtype), None
        for i, layer in enumerate(self.layers):
            h, a = add_rms_norm(h, r, layer.attn_norm, cfg.rms_eps)
            q, k, v = linear(a, fused.qkv[i]).split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = norm_rope(q.view(T, H, D), layer.q_norm, cos, sin, cfg.rms_eps)
            write_kv(k.view(T, Hkv, D), v.view(T, Hkv, D), layer.k_norm, (cos, sin), cache.k[i], cache.v[i], slots,
                     cfg.rms_eps)
            att = static_attention(q, cache.k[i], cache.v[i], visible, slots)  # [T, H * D]
            h, m = add_rms_norm(h, linear(att, layer.o), layer.ffn_norm, cfg.rms_eps)
            gate, up = linear(m, fused.gate_up[i]).chunk(2, dim=-1)
            r = linear(swiglu(gate, up), layer.down)
        return add_rms_norm(h, r, self.norm, cfg.rms_eps)[1]


@dataclass(frozen=True)
class FusedDraftWeights:
    """Each draft layer's q, k, v and gate, up matrices concatenated (one product each), for
    ``DFlashDraft.forward_in_cache``, and its k, v (a context row's, ``write_context``: the rows of the q, k, v
    copy past q's, a view): copies of the draft's weights."""

    qkv: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    kv: list[torch.Tensor]

    @classmethod
    def of(cls, draft: DFlashDraft) -> "FusedDraftWeights":
        """The draft's merged matrices, made once and kept on the draft until one of its
        parameters changes (a real-scale draft's would be hundreds of MB per generation)."""
        # inference tensors keep no version counter: only their addresses then
        key = tuple((p.data_ptr(), -1 if p.is_inference() else p._version) for p in draft.parameters())
        cached = getattr(draft, "_fused_weights", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        with torch.no_grad():
            qkv = [torch.cat([l.q, l.k, l.v]).detach() for l in draft.layers]
            fused = cls(qkv, [torch.cat([l.gate, l.up]).detach() for l in draft.layers],
                        [t[draft.cfg.n_head * draft.cfg.head_dim:] for t in qkv])
        object.__setattr__(draft, "_fused_weights", (key, fused))  # a plain attribute, not a module buffer
        return fused


def in_cache_blocker(cfg: DraftConfig) -> str | None:
    """Why ``forward_in_cache`` cannot run a draft of ``cfg``, or None."""
    if cfg.causal:
        return "its block attention is causal"
    if any(cfg.window(i) for i in range(cfg.n_layers)):
        return "it has sliding-window layers"
    return None


def _visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, window: int,
                extra: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean [..., T, K] mask of the keys each query may see, or None when it sees them all."""
    mask = extra
    if causal or window:
        rel = q_pos[..., :, None] - k_pos[..., None, :]  # >= 0 for keys at or before the query
        m = torch.ones_like(rel, dtype=torch.bool)
        if causal:
            m &= rel >= 0
        if window:
            m &= rel.abs() < window
        mask = m if mask is None else mask & m
    return mask


@dataclass
class DraftCache:
    """Context keys/values of every draft layer, preallocated to ``max_len`` rows."""

    k: list[torch.Tensor]  # per layer [n_head_kv, max_len, head_dim]
    v: list[torch.Tensor]
    positions: torch.Tensor  # [max_len] long
    length: int = 0

    @classmethod
    def empty(cls, draft: DFlashDraft, max_len: int) -> "DraftCache":
        cfg = draft.cfg
        shape = (cfg.n_head_kv, max_len, cfg.head_dim)
        kw = {"device": draft.device, "dtype": draft.dtype}
        return cls([torch.zeros(shape, **kw) for _ in range(cfg.n_layers)],
                   [torch.zeros(shape, **kw) for _ in range(cfg.n_layers)],
                   torch.zeros(max_len, dtype=torch.long, device=draft.device))

    @property
    def max_len(self) -> int:
        return self.positions.shape[0]

    def extend(self, draft: DFlashDraft, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append the context rows ``features`` [C, n_features * hidden] at ``positions`` [C]."""
        end = self.length + features.shape[0]
        if end > self.max_len:
            raise ValueError(f"draft cache holds {self.max_len} context rows; {end} were asked for")
        for i, (k, v) in enumerate(draft.project_context(features, positions)):
            self.k[i][:, self.length:end] = k
            self.v[i][:, self.length:end] = v
        self.positions[self.length:end] = positions
        self.length = end

    def context(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        n = self.length
        return [(k[:, :n], v[:, :n]) for k, v in zip(self.k, self.v)], self.positions[:n]


def block_hidden(draft: DFlashDraft, cache: DraftCache, block_embeddings: torch.Tensor, start: int) -> torch.Tensor:
    """Normed draft hidden states [B, hidden] of a block whose first slot sits at position ``start``."""
    B = block_embeddings.shape[0]
    positions = torch.arange(start, start + B, device=block_embeddings.device)
    context, context_positions = cache.context()
    return draft(block_embeddings, positions, context, context_positions)
