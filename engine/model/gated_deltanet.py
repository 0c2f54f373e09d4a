"""Gated DeltaNet mixer of qwen35moe: causal conv, gated delta rule, gated RMSNorm.

Per value head, with state ``S`` [head_k, head_v] in float32 and per token ``t``:
``S = exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S = S + k_t u_t^T;  o_t = S^T q_t``.
The torch reference has a token-by-token form (decode) and a chunked form (prefill); on
CUDA fla's Triton kernels replace both when fla is importable. The captured decode step
uses ``decode_delta_rule`` instead (the repository's own Triton decode kernel on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.kernels import fused
from engine.model.config import ModelConfig
from engine.model.weights import GDNWeights
from engine.model.linear import linear
from engine.model.norm import rms_norm

CHUNK = 64
# Up to this many tokens the token-by-token form is used: decode and short verify blocks.
RECURRENT_MAX_TOKENS = 4
# Up to this many tokens a ``DeltaRule`` with a ``short`` kernel uses it (DFlash verify blocks).
SHORT_MAX_TOKENS = 16
# True: a delta rule with ``takes_norm`` applies the gated norm itself when ``gdn_forward`` passes
# ``norm=`` (the Triton decode kernel does it in its own launch). Off: on the H200 the captured 35B
# step ran 0.01-0.07 ms slower with the norm inside in 5 of 6 alternating pairs (docs/benchmarks.md),
# although it has 30 launches fewer.
NORM_IN_RULE = False

# (q, k, v, g, beta, state, scale) -> (o, new state); q, k [T, H, dk] unit rows, v [T, H, dv],
# g, beta [T, H] float32, state [H, dk, dv] float32; o [T, H, dv].
DeltaRuleFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Unit-length rows in float32 (``x / sqrt(sum x^2 + eps)``, the convention of HF and fla).

    On CUDA this is the one-launch RMSNorm with weight ``1 / sqrt(D)`` and epsilon ``eps / D``
    (the same quantity: ``x sqrt(D) / sqrt(sum x^2 + eps) / sqrt(D)``) where its kernel applies.
    """
    if x.is_cuda:
        D = x.shape[-1]
        return rms_norm(x, _unit_weight(D, x.device), eps / D, out_dtype=torch.float32)
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


_UNIT_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _unit_weight(dim: int, device: torch.device) -> torch.Tensor:
    """A constant [dim] tensor of ``1 / sqrt(dim)`` on ``device``, made once (a CUDA graph may hold it)."""
    key = (dim, device)
    if key not in _UNIT_WEIGHTS:
        with torch.inference_mode(False), torch.no_grad():
            _UNIT_WEIGHTS[key] = torch.full((dim,), dim ** -0.5, dtype=torch.float32, device=device)
    return _UNIT_WEIGHTS[key]


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, scale: float, *,
                         states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (the definition), float32 inside. ``states`` [T, H, dk, dv]:
    also receives the state after each token."""
    s = state.float().clone()
    q, k, v = q.float() * scale, k.float(), v.float()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kt = k[t]  # [H, dk]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, kt))
        s = s + kt[:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
        if states is not None:
            states[t].copy_(s)
    return out, s


delta_rule_recurrent.takes_states = True  # ``states=``: see above


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, scale: float, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (WY form), float32 inside; any length, starts from ``state``.

    Within a chunk, with ``G_t`` the cumulative log decay and ``L[t, s] = exp(G_t - G_s)``
    for s <= t, the corrections solve ``(I + A) u = beta v - beta exp(G) (K S0)`` with
    ``A[t, s] = beta_t L[t, s] k_t.k_s`` (s < t); then
    ``O = exp(G) Q S0 + (L * Q K^T) u`` and ``S = exp(G_C) S0 + (exp(G_C - G) K)^T u``.
    """
    T, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    n = (T + pad) // chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, n, chunk, ...], zero padded
        x = F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.reshape(n, chunk, H, *x.shape[2:]).permute(2, 0, 1, *range(3, x.dim() + 1))

    q, k, v = blocks(q) * scale, blocks(k), blocks(v)  # [H, n, C, d]
    g, beta = blocks(g), blocks(beta)  # [H, n, C]; padded tokens neither decay nor write
    cum = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, n, C, C]
    a = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = a + torch.eye(chunk, device=q.device)
    u_base = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, (beta * cum.exp())[..., None] * k, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()  # [H, n]

    s = state.float()
    out = torch.empty(H, n, chunk, dv, device=q.device, dtype=torch.float32)
    for i in range(n):
        u = u_base[:, i] - w[:, i] @ s  # [H, C, dv]
        out[:, i] = q_decayed[:, i] @ s + qk[:, i] @ u
        s = chunk_decay[:, i, None, None] * s + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.permute(1, 2, 0, 3).reshape(n * chunk, H, dv)[:T]
    return out, s


def _fla_kernels() -> tuple[DeltaRuleFn, DeltaRuleFn] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None

    def wrap(kernel: Callable) -> DeltaRuleFn:
        def run(q, k, v, g, beta, state, scale):
            # keywords only: the two kernels' positional parameters differ (gk, gv in fused_recurrent)
            o, s = kernel(q=q[None].to(v.dtype).contiguous(), k=k[None].to(v.dtype).contiguous(),
                          v=v[None].contiguous(), g=g[None].contiguous(), beta=beta[None].contiguous(),
                          scale=scale, initial_state=state[None].float().contiguous(), output_final_state=True)
            return o[0], s[0]
        return run

    return wrap(chunk_gated_delta_rule), wrap(fused_recurrent_gated_delta_rule)


@dataclass(frozen=True)
class DeltaRule:
    """The chunked (prefill) and token-by-token (decode) implementations in use.

    ``short``, when set, takes every call of at most ``SHORT_MAX_TOKENS`` tokens whose head
    sizes it handles: on CUDA the Triton decode kernel, which keeps the state and its products
    in float32. fla's chunk kernel forms its products in reduced precision (1e-3 relative error
    in float32 on an H200, 5e-2 in the bf16 logits of a verify block), enough to flip greedy
    near-ties between a DFlash verify block and token-by-token decoding.
    """

    chunk: DeltaRuleFn
    recurrent: DeltaRuleFn
    backend: str  # "torch" or "fla"
    short: DeltaRuleFn | None = None
    short_head_dim: int = 0  # largest head size ``short`` handles

    @classmethod
    def select(cls, device: torch.device | str, *, force_torch: bool = False) -> "DeltaRule":
        """fla's Triton kernels on CUDA when importable, the torch reference otherwise or when forced;
        short calls on CUDA go to the engine's Triton decode kernel when Triton is importable."""
        if not force_torch and torch.device(device).type == "cuda":
            kernels = _fla_kernels()
            short = _short_kernel()
            if kernels is not None:
                return cls(kernels[0], kernels[1], "fla", *short)
            if short[0] is not None:
                return cls(delta_rule_chunked, delta_rule_recurrent, "torch", *short)
        return cls(delta_rule_chunked, delta_rule_recurrent, "torch")

    @property
    def name(self) -> str:
        """The back ends in use, short calls' first when there is one (``triton+fla``)."""
        return f"triton+{self.backend}" if self.short is not None else self.backend

    takes_norm = True  # ``norm=``: the output through the gated norm (``gdn_forward``)

    def __call__(self, q, k, v, g, beta, state, scale, norm=None):
        T = q.shape[0]
        fn = self.recurrent if T <= RECURRENT_MAX_TOKENS else self.chunk
        if (self.short is not None and T <= SHORT_MAX_TOKENS
                and max(q.shape[-1], v.shape[-1]) <= self.short_head_dim):
            if norm is not None and getattr(self.short, "takes_norm", False):
                return self.short(q, k, v, g, beta, state, scale, norm=norm)
            fn = self.short
        o, s = fn(q, k, v, g, beta, state, scale)
        return (gated_norm(o, norm) if norm is not None else o), s


def _short_kernel() -> tuple[DeltaRuleFn | None, int]:
    try:
        from engine.kernels.gdn_decode import MAX_HEAD_DIM, delta_rule_decode_triton
    except ImportError:
        return None, 0
    return delta_rule_decode_triton, MAX_HEAD_DIM


def decode_delta_rule(head_k: int, head_v: int, *, impl: str, in_place: bool = True) -> tuple[DeltaRuleFn, str]:
    """The delta rule of a fixed-shape decode step (1 to 16 tokens) and its backend name.

    ``triton``: the Triton decode kernel (``engine.kernels.gdn_decode``), for head sizes it
    handles (on the CPU it needs TRITON_INTERPRET=1); it writes the new state over the old one,
    or to a new tensor with ``in_place=False``. ``torch``, or head sizes beyond the kernel: the
    token-by-token torch definition (a new tensor). Neither synchronises with the host. Both take
    ``states=`` (the state after each token, for a verify block's restore).
    """
    if impl not in ("triton", "torch"):
        raise ValueError(f"delta rule implementation must be triton or torch, got {impl!r}")
    if impl == "triton":
        from engine.kernels.gdn_decode import MAX_HEAD_DIM, delta_rule_decode_triton

        if max(head_k, head_v) <= MAX_HEAD_DIM:
            def triton_rule(q, k, v, g, beta, state, scale, norm=None, states=None):
                return delta_rule_decode_triton(q, k, v, g, beta, state, scale, out_state=state if in_place else None,
                                                norm=norm, states=states)

            triton_rule.takes_norm = triton_rule.takes_states = True
            return triton_rule, "triton"
    return delta_rule_recurrent, "torch"


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [T, C] continuing from ``state`` [C, K-1]; returns (out [T, C], new state).
    ``keep`` [K-1] (device indices into the state then x's columns): the new state's columns, rather
    than the last K-1 (a padded call's state ends at its last real token: ``PadMask``)."""
    padded = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K-1+T]
    out = F.conv1d(padded[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, T]
    new = padded[:, padded.shape[1] - state.shape[1]:] if keep is None else padded.index_select(1, keep)
    return out.transpose(0, 1), new


def _per_value_head(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[T, hk, d] -> [T, hv, d], key head p // (hv / hk) at value head p (a copy, no host sync)."""
    T, hk, d = x.shape
    return x[:, :, None].expand(T, hk, hv // hk, d).reshape(T, hv, d)


@dataclass(frozen=True)
class PadMask:
    """Which of a call's tokens are real when a prompt is padded at its end to a fixed length (a captured
    prefill): the padding neither decays nor writes the recurrent state (its gate g and its beta are
    zeroed, so the delta rule leaves the state as the last real token left it), and the conv state keeps
    the inputs up to the last real token. Device tensors, so a graph replays any real length."""

    mask: torch.Tensor  # [T] float32: 1 for real tokens, 0 for padding
    conv_keep: torch.Tensor  # [K-1] long: n_real + arange(K-1), the conv window's columns to keep

    @classmethod
    def empty(cls, tokens: int, conv_kernel: int, device: torch.device | str) -> "PadMask":
        return cls(torch.ones(tokens, device=device), torch.arange(conv_kernel - 1, device=device) + tokens)

    def set(self, n_real: int) -> None:
        """Mark the first ``n_real`` tokens real (in place: a captured graph reads these buffers)."""
        T, tail = self.mask.shape[0], self.conv_keep.shape[0]
        if not 1 <= n_real <= T:
            raise ValueError(f"{n_real} real tokens do not fit a padded call of {T}")
        self.mask.copy_((torch.arange(T) < n_real).float())
        self.conv_keep.copy_(torch.arange(tail) + n_real)


@dataclass(frozen=True)
class GDNRecord:
    """Device buffers a fixed-shape step of T tokens fills for one GDN layer, so that the layer's
    state after any prefix of the T tokens can be rebuilt without running the layer again:
    the conv window (the state before the step, then the T new inputs) and the delta rule's inputs,
    or, with ``states``, the recurrent state after each token itself."""

    window: torch.Tensor  # [conv_dim, kernel - 1 + T]
    q: torch.Tensor  # [T, v_heads, head_k] float32
    k: torch.Tensor  # [T, v_heads, head_k] float32
    v: torch.Tensor  # [T, v_heads, head_v]
    g: torch.Tensor  # [T, v_heads] float32
    beta: torch.Tensor  # [T, v_heads] float32
    states: torch.Tensor | None = None  # [T, v_heads, head_k, head_v] float32: the state after each token

    @classmethod
    def empty(cls, cfg: ModelConfig, tokens: int, *, device: torch.device | str, dtype: torch.dtype,
              window: torch.Tensor | None = None, states: torch.Tensor | None = None) -> "GDNRecord":
        """Zeroed buffers; ``window``: a contiguous [conv_dim, kernel - 1 + tokens] buffer to use (a layer's row of
        one stacked buffer, so that a restore selects every layer's conv window in one launch); ``states``: a
        [tokens, v_heads, head_k, head_v] float32 buffer (likewise) that the step's delta rule fills."""
        hv, dk, dv = cfg.gdn_v_heads, cfg.gdn_head_k, cfg.gdn_head_v
        f32 = dict(device=device, dtype=torch.float32)
        shape = (cfg.gdn_conv_dim, cfg.conv_kernel - 1 + tokens)
        if window is not None and (tuple(window.shape) != shape or not window.is_contiguous()):
            raise ValueError(f"a record's window must be a contiguous {shape} buffer, got {tuple(window.shape)}")
        if states is not None and (tuple(states.shape) != (tokens, hv, dk, dv) or states.dtype != torch.float32):
            raise ValueError(f"a record's states must be a float32 {(tokens, hv, dk, dv)} buffer, got "
                             f"{states.dtype} {tuple(states.shape)}")
        return cls(window=torch.zeros(shape, device=device, dtype=dtype) if window is None else window,
                   q=torch.zeros(tokens, hv, dk, **f32), k=torch.zeros(tokens, hv, dk, **f32),
                   v=torch.zeros(tokens, hv, dv, device=device, dtype=dtype),
                   g=torch.zeros(tokens, hv, **f32), beta=torch.zeros(tokens, hv, **f32), states=states)


def replay_prefix(delta_rule: DeltaRuleFn, start: torch.Tensor, inputs: "list[tuple[torch.Tensor, ...]]", keep: int,
                  scale: float, live: torch.Tensor | None = None) -> torch.Tensor:
    """The recurrent states of several GDN layers after the first ``keep`` tokens of a step.

    ``start`` [layers, v_heads, head_k, head_v] are the states before the step and ``inputs``
    each layer's (q, k, v, g, beta) for the step's tokens. The layers' heads go side by side
    into one delta-rule call (the rule is independent per head). ``live`` [keep, 1] (1 or 0 per
    token) multiplies every layer's g and beta: a token with 0 leaves the states as they were.
    Returns the new states, shaped like ``start``.
    """
    q, k, v, g, beta = (torch.cat([x[j][:keep] for x in inputs], dim=1) for j in range(5))
    if live is not None:
        g.mul_(live)
        beta.mul_(live)
    _, s = delta_rule(q, k, v, g, beta, start.reshape(-1, *start.shape[2:]), scale)
    return s.reshape(start.shape)


# ``gdn_forward`` takes the fused Triton prologue (``engine.kernels.gdn_prologue``) on CUDA for
# calls of up to this many tokens. FUSED_PROLOGUE None: where it applies; True: for every call
# of up to that many tokens, whatever the device (tests, with TRITON_INTERPRET=1); False: never.
PROLOGUE_MAX_TOKENS = 16
FUSED_PROLOGUE: bool | None = None
PROLOGUE = "Gated DeltaNet prologue"


def gdn_prologue_reference(qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                           b: torch.Tensor, alpha: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
                           cfg: ModelConfig, pad: PadMask | None = None) -> tuple[torch.Tensor, ...]:
    """The delta rule's inputs from the projections: (q, k [T, hv, dk] unit rows, v [T, hv, dv],
    g, beta [T, hv] float32). ``conv_state`` is updated in place. ``pad``: the padding's g and beta
    are zero and the conv state ends at the last real token."""
    mixed, new_conv = causal_conv(qkv, conv_state, conv_weight, None if pad is None else pad.conv_keep)
    conv_state.copy_(new_conv)
    q, k, v, g, beta = _prologue_after_conv(mixed, b, alpha, a, dt_bias, cfg)
    if pad is not None:
        g, beta = g * pad.mask[:, None], beta * pad.mask[:, None]
    return q, k, v, g, beta


def _prologue_after_conv(mixed: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, a: torch.Tensor,
                         dt_bias: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """``gdn_prologue_reference`` from the causal conv's output [T, conv_dim] on (token by token)."""
    T = mixed.shape[0]
    hk, hv, dk, dv = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_head_k, cfg.gdn_head_v
    mixed = F.silu(mixed)
    q, k, v = mixed.split([cfg.gdn_key_dim, cfg.gdn_key_dim, cfg.gdn_value_dim], dim=-1)
    # value head p reads key head p // (hv / hk): HF/fla order, undone from GGUF's tiling at load
    q = _per_value_head(l2norm(q.reshape(T, hk, dk)), hv)
    k = _per_value_head(l2norm(k.reshape(T, hk, dk)), hv)
    v = v.reshape(T, hv, dv)
    beta = torch.sigmoid(b.float())
    g = a * F.softplus(alpha.float() + dt_bias)
    return q, k, v, g, beta


def _fused_prologue(qkv: torch.Tensor, w: GDNWeights, cfg: ModelConfig) -> bool:
    if FUSED_PROLOGUE is not None:
        return FUSED_PROLOGUE and qkv.shape[0] <= PROLOGUE_MAX_TOKENS
    return (qkv.is_cuda and qkv.shape[0] <= PROLOGUE_MAX_TOKENS and fused.allowed(PROLOGUE)
            and cfg.gdn_v_heads % cfg.gdn_k_heads == 0 and max(cfg.gdn_head_k, cfg.gdn_head_v) <= 256
            and not (torch.is_grad_enabled() and (qkv.requires_grad or w.conv.requires_grad)))


def _prologue_kernel():
    from engine.kernels.gdn_prologue import gdn_prologue_triton

    return gdn_prologue_triton


def gdn_forward(w: GDNWeights, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                cfg: ModelConfig, delta_rule: DeltaRuleFn, record: GDNRecord | None = None,
                pad: PadMask | None = None) -> torch.Tensor:
    """x [T, hidden] (already normed) -> [T, hidden]; updates both states in place and, with
    ``record``, copies what rebuilding a shorter prefix's state needs into its buffers. ``pad``: x's
    last tokens are padding, and the states are left as the real tokens leave them."""
    hv, dk, dv = cfg.gdn_v_heads, cfg.gdn_head_k, cfg.gdn_head_v
    if record is not None and pad is not None:
        raise ValueError("a padded call keeps no record")
    extra = {}
    if record is not None and record.states is not None:  # the state after each token, into the record
        if not getattr(delta_rule, "takes_states", False):
            raise ValueError(f"a record with per-token states needs a delta rule that writes them; "
                             f"{getattr(delta_rule, '__name__', delta_rule)!r} does not")
        extra["states"] = record.states
    qkv, z, b, alpha = _gdn_projections(w, x, cfg)
    inputs = None
    if pad is None and _fused_prologue(qkv, w, cfg):  # one launch; with a record, straight into its buffers
        out = (record.q, record.k, record.v, record.g, record.beta) if record is not None else None
        inputs = fused.attempt(PROLOGUE, FUSED_PROLOGUE, lambda: _prologue_kernel()(
            qkv, conv_state, w.conv, b, alpha, w.a, w.dt_bias, k_heads=cfg.gdn_k_heads, v_heads=hv,
            head_k=dk, head_v=dv, out=out, window=record.window if record is not None else None))
    if inputs is not None:
        q, k, v, g, beta = inputs
    else:
        if record is not None:
            tail = conv_state.shape[1]
            record.window[:, :tail].copy_(conv_state)
            record.window[:, tail:].copy_(qkv.transpose(0, 1))
        q, k, v, g, beta = gdn_prologue_reference(qkv, conv_state, w.conv, b, alpha, w.a, w.dt_bias, cfg, pad)
        if record is not None and record.states is None:  # a replay's inputs (per-token states need none)
            for buf, t in zip((record.q, record.k, record.v, record.g, record.beta), (q, k, v, g, beta)):
                buf.copy_(t)
    T = x.shape[0]
    norm = (z.view(T, hv, dv), w.norm, cfg.rms_eps, x.dtype)
    if NORM_IN_RULE and getattr(delta_rule, "takes_norm", False):  # the gated norm inside the rule's launch
        y, s = delta_rule(q, k, v, g, beta, recurrent_state, dk ** -0.5, norm=norm, **extra)
    else:
        o, s = delta_rule(q, k, v, g, beta, recurrent_state, dk ** -0.5, **extra)
        y = gated_norm(o, norm)
    recurrent_state.copy_(s)
    return linear(y.reshape(T, hv * dv), w.out)


def _gdn_projections(w: GDNWeights, x: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """qkv [T, conv_dim], z [T, value_dim], b and alpha [T, hv] from the normed x [T, hidden]."""
    hv = cfg.gdn_v_heads
    if w.in_proj is not None:  # the four input projections in one matrix product, split by columns
        return linear(x, w.in_proj).split([cfg.gdn_conv_dim, cfg.gdn_value_dim, hv, hv], dim=-1)
    return linear(x, w.qkv), linear(x, w.z), linear(x, w.beta), linear(x, w.alpha)


def gated_norm(o: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor, float, torch.dtype]) -> torch.Tensor:
    """The delta rule's output o [T, hv, dv] through Gated DeltaNet's gated RMSNorm: ``norm`` is
    (gate [T, hv, dv], weight [dv], eps, output dtype); float32 inside."""
    gate, weight, eps, dtype = norm
    return rms_norm(o, weight, eps, gate=gate, out_dtype=dtype)


def _gdn_output(w: GDNWeights, o: torch.Tensor, z: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """The delta rule's output o [T, hv, dv] through the gated RMSNorm (gate z) and the output projection."""
    T, hv, dv = o.shape
    o = gated_norm(o, (z.view(T, hv, dv), w.norm, cfg.rms_eps, dtype))
    return linear(o.reshape(T, hv * dv), w.out)


def gdn_rows(w: GDNWeights, x: torch.Tensor, rows: int, cfg: ModelConfig, delta_rule: DeltaRuleFn) -> torch.Tensor:
    """``gdn_forward`` over ``rows`` sequences of equal length from empty states, each its own
    recurrence: x [rows * L, hidden] (row-major) -> [rows * L, hidden]. The projections and the
    token-wise parts run once over every token; the causal conv restarts at each row; the delta
    rule takes the rows as extra heads (heads never mix), in one call."""
    T = x.shape[0]
    if rows < 1 or T % rows:
        raise ValueError(f"{T} tokens do not split into {rows} rows of equal length")
    L = T // rows
    hv, dk, dv = cfg.gdn_v_heads, cfg.gdn_head_k, cfg.gdn_head_v
    qkv, z, b, alpha = _gdn_projections(w, x, cfg)
    C, K = qkv.shape[-1], w.conv.shape[-1]
    seq = F.pad(qkv.reshape(rows, L, C).transpose(1, 2), (K - 1, 0))  # [rows, C, K-1+L]: empty conv states
    mixed = F.conv1d(seq, w.conv[:, None, :].to(seq.dtype), groups=C).transpose(1, 2).reshape(T, C)
    q, k, v, g, beta = _prologue_after_conv(mixed, b, alpha, w.a, w.dt_bias, cfg)

    def as_heads(t: torch.Tensor) -> torch.Tensor:  # [rows * L, hv, ...] -> [L, rows * hv, ...]
        return t.reshape(rows, L, hv, *t.shape[2:]).transpose(0, 1).reshape(L, rows * hv, *t.shape[2:])

    state = torch.zeros(rows * hv, dk, dv, dtype=torch.float32, device=x.device)
    o, _ = delta_rule(as_heads(q), as_heads(k), as_heads(v), as_heads(g), as_heads(beta), state, dk ** -0.5)
    o = o.reshape(L, rows, hv, dv).transpose(0, 1).reshape(T, hv, dv)
    return _gdn_output(w, o, z, cfg, x.dtype)
