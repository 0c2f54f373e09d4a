"""Verify a drafted block in one target forward, then roll the target's state back to the
accepted prefix.

KV caches crop for free. Gated DeltaNet conv and recurrent states only move forward, so two
strategies bring them back to "after ``keep`` of the ``n`` verified tokens":

- ``recompute``: snapshot the GDN states before the verify; on a partial acceptance restore
  them, crop the KV caches to the pre-verify length and run the target again over the kept
  tokens (one extra target forward, experts included).
- ``capture``: during the verify, record per GDN layer what the state at every token is a
  function of: the delta-rule inputs (q, k, v, g, beta) and the layer's input rows. The state
  at token ``keep`` is then materialised for the accepted slot only: one delta-rule call over
  all GDN layers at once (their heads stacked) and, for the conv, the ``qkv`` projection of
  the last ``conv_kernel - 1`` kept rows. No expert runs again.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F

from engine.model.gated_deltanet import replay_prefix
from engine.model.norm import rms_norm
from engine.model.qwen35moe import ForwardOutput, Qwen35MoE
from engine.model.state import ModelState
from engine.model.linear import linear

ROLLBACK_MODES = ("capture", "recompute")


class Rollback(Protocol):
    def verify(self, ids: torch.Tensor, capture_layers: tuple[int, ...]) -> ForwardOutput:
        """Run ``ids`` [n] through the target with all logits, advancing the state by n."""
        ...

    def rollback(self, keep: int) -> None:
        """Leave the state as if only the first ``keep`` verified tokens had been run."""
        ...


class _Base:
    def __init__(self, model: Qwen35MoE, state: ModelState) -> None:
        self.model = model
        self.state = state
        self.gdn_layers = model.cfg.gdn_layers
        self.base_len = 0
        self.base_position = 0
        self.ids: torch.Tensor | None = None
        # [n_gdn, v_heads, head_k, head_v] float32 and [n_gdn, conv_dim, kernel - 1]: pre-verify states
        self.recurrent0 = torch.stack([state.recurrent[i] for i in self.gdn_layers]) if self.gdn_layers else None
        self.conv0 = torch.stack([state.conv[i] for i in self.gdn_layers]) if self.gdn_layers else None

    def _snapshot(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.base_len = self.state.seq_len
        self.base_position = self.state.next_position
        if self.gdn_layers:
            torch.stack([self.state.recurrent[i] for i in self.gdn_layers], out=self.recurrent0)
            torch.stack([self.state.conv[i] for i in self.gdn_layers], out=self.conv0)

    def _crop(self, length: int) -> None:
        for cache in self.state.kv.values():
            cache.crop(length)
        self.state.seq_len = length
        self.state.next_position = self.base_position + (length - self.base_len)


class RecomputeRollback(_Base):
    def verify(self, ids: torch.Tensor, capture_layers: tuple[int, ...]) -> ForwardOutput:
        self._snapshot(ids)
        return self.model.forward(ids, self.state, capture_layers=capture_layers, logits="all")

    def rollback(self, keep: int) -> None:
        if keep == self.ids.shape[0]:
            return
        self._crop(self.base_len)
        for j, i in enumerate(self.gdn_layers):
            self.state.recurrent[i].copy_(self.recurrent0[j])
            self.state.conv[i].copy_(self.conv0[j])
        self.model.forward(self.ids[:keep], self.state, logits="none")


class _Recorder:
    """Stands in for the model's delta rule during a verify: records each GDN layer's inputs."""

    def __init__(self, delta_rule) -> None:
        self.delta_rule = delta_rule
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, q, k, v, g, beta, state, scale):
        self.calls.append((q, k, v, g, beta))
        self.scale = scale
        return self.delta_rule(q, k, v, g, beta, state, scale)


@contextmanager
def _recording(model: Qwen35MoE) -> Iterator[_Recorder]:
    recorder = _Recorder(model.delta_rule)
    model.delta_rule = recorder
    try:
        yield recorder
    finally:
        model.delta_rule = recorder.delta_rule


class CaptureRollback(_Base):
    def __init__(self, model: Qwen35MoE, state: ModelState) -> None:
        super().__init__(model, state)
        # the residual stream entering each GDN layer: the previous layer's output (embeddings for layer 0)
        self.input_layers = tuple(i - 1 for i in self.gdn_layers if i > 0)
        self.recorder: _Recorder | None = None
        self.hidden: dict[int, torch.Tensor] = {}

    def verify(self, ids: torch.Tensor, capture_layers: tuple[int, ...]) -> ForwardOutput:
        self._snapshot(ids)
        with _recording(self.model) as recorder:
            out = self.model.forward(ids, self.state, capture_layers=set(capture_layers) | set(self.input_layers),
                                     logits="all")
        if len(recorder.calls) != len(self.gdn_layers):
            raise RuntimeError(f"recorded {len(recorder.calls)} delta-rule calls for {len(self.gdn_layers)} GDN layers")
        self.recorder, self.hidden = recorder, out.hidden
        return out

    def rollback(self, keep: int) -> None:
        if keep == self.ids.shape[0]:
            return
        self._crop(self.base_len + keep)
        if not self.gdn_layers:
            return
        self._restore_recurrent(keep)
        self._restore_conv(keep)

    def _restore_recurrent(self, keep: int) -> None:
        s = replay_prefix(self.model.delta_rule, self.recurrent0, self.recorder.calls, keep, self.recorder.scale)
        for j, i in enumerate(self.gdn_layers):
            self.state.recurrent[i].copy_(s[j])

    def _restore_conv(self, keep: int) -> None:
        cfg = self.model.cfg
        w = self.model.weights
        tail = cfg.conv_kernel - 1
        rows = slice(max(0, keep - tail), keep)
        for j, i in enumerate(self.gdn_layers):
            layer = w.layers[i]
            h = self.hidden[i - 1][rows] if i > 0 else F.embedding(self.ids[rows], w.embed)
            x = rms_norm(h, layer.attn_norm, cfg.rms_eps)
            mixer = layer.mixer  # the product the forward ran: the merged one where there is one
            qkv = (linear(x, mixer.in_proj)[:, :cfg.gdn_conv_dim] if mixer.in_proj is not None
                   else linear(x, mixer.qkv))  # [r, conv_dim]
            window = torch.cat([self.conv0[j], qkv.transpose(0, 1).to(self.conv0.dtype)], dim=1)
            self.state.conv[i].copy_(window[:, window.shape[1] - tail:])


def make_rollback(mode: str, model: Qwen35MoE, state: ModelState) -> Rollback:
    if mode == "capture":
        return CaptureRollback(model, state)
    if mode == "recompute":
        return RecomputeRollback(model, state)
    raise ValueError(f"rollback mode must be one of {ROLLBACK_MODES}, got {mode!r}")
