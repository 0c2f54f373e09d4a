"""A prompt's prefill from an empty state, captured in a CUDA graph per padded length and replayed.

An eager prefill of a short prompt is bound by the host: the 35B model launches about 4,000 kernels for
512 tokens, which takes the host far longer than the GPU's work (docs/benchmarks.md). The prefill here
pads the prompt at its end to a fixed length (``BUCKETS``) and runs ``Qwen35MoE``'s layers over device
buffers, so one graph per length replays any prompt up to it:

- attention is causal, so the real tokens never see the padding, and the KV caches' lengths are set to
  the real length afterwards (the padding's entries lie past it, never attended to, overwritten later);
- the Gated DeltaNet layers get a ``PadMask``: the padding's gate and beta are zero, so the delta rule
  leaves each recurrent state as the last real token left it, and the conv states end at that token;
- the last real token's logits are gathered at a device index.

The padding's tokens still run through the projections and the attention (at most the bucket's length
of extra work, where the host was the bound), but not through the routed experts: their routes get id
-1, which the expert kernels skip, and a hybrid executor's pair counters are corrected for them (it
must hold every expert on the device: ``applies``). The graph is bound to a state of at least the bucket's
capacity, which the engine's graphs share (one run at a time); ``Engine.generate`` copies it into the
decode step's state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.attention import attention_forward, rope_cos_sin
from engine.model.decode_graph import capture_counted, graph_blocker, placement_version
from engine.model.gated_deltanet import PadMask, gdn_forward
from engine.model.linear import linear
from engine.model.moe import FusedExpertExecutor, TorchExpertExecutor
from engine.model.qwen35moe import Qwen35MoE
from engine.model.state import ModelState
from engine.model.weights import AttentionWeights, GDNWeights

# Padded lengths, steps of 1.5x and 2x so that padding adds at most half the real tokens; longer prompts
# prefill eagerly. On the H200's 35B file (docs/benchmarks.md) the captured prefill took 300 tokens at
# 9,773 tok/s against 2,771 eagerly, 1,100 at 14,582 against 6,090 and 2,048 at 20,117 against 17,386,
# but 2,500 (padded to 3,072) at 18,087 against 19,063: past 2,048 tokens the eager prefill is no longer
# bound by the host.
BUCKETS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def applies(executor) -> bool:
    """Whether a padded prefill can run through ``executor``: a hybrid placement must hold every expert
    on the device (the model's own experts are always there)."""
    return getattr(executor, "all_hot", True)


def padded_executor(model: Qwen35MoE):
    """The experts a padded prefill runs: the model's executor, its default per-expert loop (which reads
    the routing on the host) replaced by the fused kernels over the same weights; both skip id -1."""
    executor = model.executor
    if isinstance(executor, TorchExpertExecutor):
        return FusedExpertExecutor(executor.experts, impl="auto", device=model.device)
    return executor


class _PaddedExperts:
    """``executor`` with the padding's routes set to id -1 (no expert computes them) and, for a hybrid
    placement, its pair counter corrected for them."""

    graph_safe = True

    def __init__(self, executor, real: torch.Tensor, pad_count: torch.Tensor):
        self.executor, self.real, self.pad_count = executor, real, pad_count

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        out = self.executor(layer_idx, x, torch.where(self.real[:, None], topk_ids, -1), topk_w)
        if hasattr(self.executor, "discount"):
            self.executor.discount(layer_idx, self.pad_count * topk_ids.shape[1])
        return out


def bucket_for(tokens: int) -> int | None:
    """The shortest padded length that holds ``tokens``, or None past the longest."""
    return next((b for b in BUCKETS if tokens <= b), None)


class PrefillGraph:
    """The padded prefill of ``tokens`` (a bucket) from an empty state of that capacity.

    ``graph``: None captures where ``decode_graph.graph_blocker`` allows, False runs the same
    padded step eagerly (CPU tests); ``pool`` shares a capture memory pool and ``state`` (a
    ``ModelState`` of at least ``tokens`` capacity; a new one of exactly that by default) the states
    between graphs that never replay at once.
    """

    def __init__(self, model: Qwen35MoE, tokens: int, *, graph: bool | None = None, pool=None,
                 state: ModelState | None = None):
        if tokens < 1:
            raise ValueError(f"a padded prefill takes at least 1 token, got {tokens}")
        if state is not None and state.max_len < tokens:
            raise ValueError(f"a padded prefill of {tokens} tokens needs a state of at least that many; the "
                             f"state given holds {state.max_len}")
        if not applies(model.executor):
            raise ValueError("a padded prefill needs every expert on the device; the hybrid placement holds "
                             "some on the host")
        cfg, dev = model.cfg, model.device
        self.model = model
        self.tokens = tokens
        with torch.inference_mode():
            self.state = state if state is not None else ModelState.new(cfg, tokens, device=dev, dtype=model.dtype)
            self.ids = torch.zeros(tokens, dtype=torch.long, device=dev)
            self.last = torch.zeros(1, dtype=torch.long, device=dev)  # the last real token's index
            self.pad = PadMask.empty(tokens, cfg.conv_kernel, dev)
            self._real = torch.ones(tokens, dtype=torch.bool, device=dev)
            self._pad_count = torch.zeros((), dtype=torch.long, device=dev)
            self.logits = torch.zeros(1, cfg.vocab, dtype=torch.float32, device=dev)
            positions = torch.arange(tokens, device=dev)
            self._positions = positions
            self._rope = rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta) if self.state.kv else None
        self._source = (model.executor, placement_version(model.executor))
        self._executor = padded_executor(model)
        blocker = graph_blocker(model)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._replay_counts: list[int] | None = None  # the executor's host counts one replay adds
        if graph is not False and blocker is None:
            with torch.inference_mode():
                self.graph, self._replay_counts = capture_counted(self._run, dev, model.executor, pool)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def current(self) -> bool:
        """False once the model's expert executor or its placement changed since construction."""
        executor, version = self._source
        return self.model.executor is executor and placement_version(executor) == version

    @torch.inference_mode()
    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, ModelState]:
        """Prefill ``ids`` [T], T <= ``tokens``; returns the last token's logits [vocab] float32 (a buffer
        the next run overwrites) and the state after the T tokens (this object's own)."""
        T = ids.shape[0]
        if ids.dim() != 1 or not 1 <= T <= self.tokens:
            raise ValueError(f"ids must be 1 to {self.tokens} tokens, got shape {tuple(ids.shape)}")
        self.ids[:T].copy_(ids)
        self.ids[T:].zero_()
        self.last.fill_(T - 1)
        self.pad.set(T)
        if self.graph is not None:
            self.graph.replay()
            if self._replay_counts is not None:
                self.model.executor.add_host_counts(self._replay_counts)
        else:
            self._run()
        state = self.state
        for c in state.kv.values():
            c.length = T
        state.seq_len = state.next_position = T
        return self.logits[0], state

    def _run(self) -> None:
        """The padded prefill over the device buffers: starts from zeroed states, writes the logits."""
        model, state, cfg = self.model, self.state, self.model.cfg
        for t in (*state.conv.values(), *state.recurrent.values()):
            t.zero_()
        for c in state.kv.values():
            c.length = 0
        torch.gt(self.pad.mask, 0, out=self._real)
        torch.sub(self.tokens, self._real.sum(), out=self._pad_count)
        executor = _PaddedExperts(self._executor, self._real, self._pad_count)

        def attend(i: int, mixer: AttentionWeights, x: torch.Tensor) -> torch.Tensor:
            return attention_forward(mixer, x, self._positions, state.kv[i], cfg, self._rope)

        def gdn(i: int, mixer: GDNWeights, x: torch.Tensor) -> torch.Tensor:
            return gdn_forward(mixer, x, state.conv[i], state.recurrent[i], cfg, model.delta_rule, pad=self.pad)

        h = F.embedding(self.ids, model.weights.embed)
        final, _ = model.run_layers(h, state, attend, delta_rule=model.delta_rule, executor=executor,
                                    observer=None, gdn=gdn)
        self.logits.copy_(linear(final.index_select(0, self.last), model.weights.output))

