"""Qwen35MoE: the qwen35moe forward pass assembled from its layers.

Layer ``i``: ``h = x + Mixer(norm(x))`` (gated attention or Gated DeltaNet), then
``out = h + MoE(norm(h))``; final norm, then the output head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Sequence

import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.model.attention import attention_forward, attention_rows, rope_cos_sin
from engine.model.config import ModelConfig
from engine.model.gated_deltanet import DeltaRule, DeltaRuleFn, GDNRecord, gdn_forward, gdn_rows
from engine.model.moe import ExpertExecutor, RoutingObserver, TorchExpertExecutor, add_norm_route, moe_forward
from engine.model.norm import add_rms_norm
from engine.model.state import ModelState
from engine.model.weights import AttentionWeights, GDNWeights, ModelWeights, TensorSource, load_weights
from engine.model.linear import linear

LOGITS_MODES = ("all", "last", "none")

# (layer index, its attention weights, normed input [T, hidden]) -> mixer output [T, hidden]
AttendFn = Callable[[int, AttentionWeights, torch.Tensor], torch.Tensor]
GDNFn = Callable[[int, GDNWeights, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor | None  # float32 [T, vocab] ("all"), [1, vocab] ("last") or None ("none")
    final_hidden: torch.Tensor  # [T, hidden], after the final norm (the output head's input)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, hidden] residual stream after it


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Qwen35MoE:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, *, device: torch.device | str,
                 dtype: torch.dtype, delta_rule: DeltaRule):
        self.cfg = cfg
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self.delta_rule = delta_rule
        self.executor: ExpertExecutor = TorchExpertExecutor([layer.moe.experts for layer in weights.layers])
        self.routing_observer: RoutingObserver | None = None

    @classmethod
    def from_gguf(cls, gguf_file: TensorSource, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                  force_torch_gdn: bool = False, quantized: bool = False,
                  expert_device: torch.device | str | None = None) -> "Qwen35MoE":
        """Load a qwen35moe GGUF file (an ``engine.gguf.reader.GGUFFile``).

        ``dtype`` defaults to float32 on the CPU and bfloat16 on CUDA; ``force_torch_gdn``
        keeps the torch Gated DeltaNet path even where fla's kernels are available;
        ``quantized`` keeps block-quantized projection matrices as their GGUF blocks
        (``engine.model.weights.load_weights``); ``expert_device`` loads the routed experts
        elsewhere (host memory or ``meta``) for a hybrid placement to take over.
        """
        device = torch.device(device)
        dtype = dtype or default_dtype(device)
        cfg = ModelConfig.from_metadata(gguf_file.metadata, source=str(gguf_file.path))
        weights = load_weights(gguf_file, cfg, device=device, dtype=dtype, quantized=quantized,
                               expert_device=expert_device)
        return cls(cfg, weights, device=device, dtype=dtype,
                   delta_rule=DeltaRule.select(device, force_torch=force_torch_gdn))

    def new_state(self, max_len: int) -> ModelState:
        """An empty state whose KV caches hold ``max_len`` tokens."""
        return ModelState.new(self.cfg, max_len, device=self.device, dtype=self.dtype)

    def set_expert_executor(self, executor: ExpertExecutor) -> None:
        self.executor = executor

    def set_routing_observer(self, observer: RoutingObserver | None) -> None:
        self.routing_observer = observer

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, state: ModelState, *,
                positions: torch.Tensor | Sequence[int] | None = None, capture_layers: Iterable[int] = (),
                logits: str = "all") -> ForwardOutput:
        """Run tokens ``ids`` [T] after what ``state`` holds, and advance ``state``.

        ``positions`` [T] are the RoPE positions (default: consecutive from the state's next
        position); ``capture_layers`` name layers whose residual-stream output is returned.
        """
        cfg = self.cfg
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
        T = ids.shape[0]
        capture = set(capture_layers)
        bad = [i for i in capture if not 0 <= i < cfg.n_layers]
        if bad:
            raise ValueError(f"capture_layers {sorted(bad)} outside 0..{cfg.n_layers - 1}")
        full = [i for i, c in state.kv.items() if c.length + T > c.max_len]
        if full:
            raise ConfigError(f"{T} more tokens do not fit the state's KV caches of {state.max_len} tokens "
                             f"({state.seq_len} held)")
        if positions is None:
            pos = torch.arange(state.next_position, state.next_position + T, device=self.device)
            next_position = state.next_position + T
        else:
            pos = torch.as_tensor(positions, device=self.device).long()
            if pos.shape != (T,):
                raise ValueError(f"positions must have shape ({T},), got {tuple(pos.shape)}")
            next_position = int(pos[-1]) + 1

        rope = rope_cos_sin(pos, cfg.rope_dim, cfg.rope_theta) if state.kv else None  # once for every layer

        def attend(i: int, mixer: AttentionWeights, x: torch.Tensor) -> torch.Tensor:
            return attention_forward(mixer, x, pos, state.kv[i], cfg, rope)

        h = F.embedding(ids.to(self.device), self.weights.embed)
        final, hidden = self.run_layers(h, state, attend, delta_rule=self.delta_rule, executor=self.executor,
                                        observer=self.routing_observer, capture=capture)
        state.seq_len += T
        state.next_position = next_position

        out = None
        if logits != "none":
            out = linear(final if logits == "all" else final[-1:], self.weights.output).float()
        return ForwardOutput(logits=out, final_hidden=final, hidden=hidden)

    @torch.inference_mode()
    def forward_rows(self, ids: torch.Tensor, *, capture_layers: Iterable[int] = ()
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``forward`` of each row of ``ids`` [R, L] from an empty state, all rows in one pass: the
        token-wise work (norms, projections, experts) over every token at once, each row's
        attention causal over itself, its Gated DeltaNet recurrence its own. Returns the final
        hidden [R, L, hidden] and the residual stream after each layer in ``capture_layers``
        ([R, L, hidden]); no state is kept (training passes over sequences of one length)."""
        if ids.dim() != 2 or ids.numel() == 0:
            raise ValueError(f"ids must be a non-empty [rows, length] tensor, got shape {tuple(ids.shape)}")
        R, L = ids.shape
        cfg = self.cfg
        capture = set(capture_layers)
        if bad := [i for i in capture if not 0 <= i < cfg.n_layers]:
            raise ValueError(f"capture_layers {sorted(bad)} outside 0..{cfg.n_layers - 1}")
        cos, sin = rope_cos_sin(torch.arange(L, device=self.device), cfg.rope_dim, cfg.rope_theta)
        rope = (cos.repeat(R, 1), sin.repeat(R, 1))
        h = F.embedding(ids.reshape(-1).to(self.device), self.weights.embed)
        final, hidden = self.run_layers(
            h, None, lambda i, w, x: attention_rows(w, x, R, cfg, rope), delta_rule=self.delta_rule,
            executor=self.executor, observer=self.routing_observer, capture=capture,
            gdn=lambda i, w, x: gdn_rows(w, x, R, cfg, self.delta_rule))
        return final.view(R, L, -1), {i: t.view(R, L, -1) for i, t in hidden.items()}

    def run_layers(self, h: torch.Tensor, state: ModelState | None, attend: AttendFn, *, delta_rule: DeltaRuleFn,
                   executor: ExpertExecutor, observer: RoutingObserver | None = None,
                   capture: Collection[int] = (), record: "dict[int, GDNRecord] | None" = None,
                   gdn: GDNFn | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Every layer over the embedded tokens ``h`` [T, hidden], then the final norm.

        ``attend`` runs the attention mixers (it owns their KV caches); the Gated DeltaNet
        states of ``state`` are updated in place, or ``gdn(i, mixer, x)`` runs those mixers
        instead (then ``state`` may be None). Returns the final hidden [T, hidden] and the
        residual stream after each layer in ``capture``; ``record`` (GDN layer -> buffers) keeps
        what rebuilding a shorter prefix's GDN states needs. ``state``'s lengths are the caller's.
        """
        cfg = self.cfg
        hidden: dict[int, torch.Tensor] = {}
        pending = None  # the last MoE output, added into h together with the next norm
        begin = getattr(executor, "begin_layer", None)  # e.g. a hybrid executor fetching cold experts ahead
        for i, layer in enumerate(self.weights.layers):
            h, x = add_rms_norm(h, pending, layer.attn_norm, cfg.rms_eps)
            if begin is not None:
                begin(i, x)
            if i - 1 in capture:
                hidden[i - 1] = h
            if isinstance(layer.mixer, AttentionWeights):
                mixed = attend(i, layer.mixer, x)
            elif gdn is not None:
                mixed = gdn(i, layer.mixer, x)
            else:
                mixed = gdn_forward(layer.mixer, x, state.conv[i], state.recurrent[i], cfg, delta_rule,
                                    record[i] if record else None)
            h, x, routed = add_norm_route(h, mixed, layer.post_norm, cfg.rms_eps, layer.moe, cfg.n_expert_used)
            pending = moe_forward(layer.moe, x, i, cfg, executor, observer, routed)
        h, final = add_rms_norm(h, pending, self.weights.output_norm, cfg.rms_eps)
        if len(self.weights.layers) - 1 in capture:
            hidden[len(self.weights.layers) - 1] = h
        return final, hidden
