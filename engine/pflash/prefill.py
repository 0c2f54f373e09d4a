"""Compressed prefill: the target prefills only the tokens the drafter kept.

The kept tokens go through the target's normal forward (whatever expert executor it runs,
hybrid placement included) at their original positions, or renumbered; the returned state
continues at the position after the prompt, so a plain or a speculative decode loop starts
from it as from an ordinary prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from engine.errors import ConfigError
from engine.model.qwen35moe import ForwardOutput, Qwen35MoE
from engine.model.state import ModelState
from engine.pflash.drafter import Drafter
from engine.pflash.select import PFlashConfig, Selection, pflash_select


@dataclass(frozen=True)
class CompressedPrefill:
    state: ModelState  # holds the kept tokens; next_position follows the prompt
    logits: torch.Tensor  # [vocab] float32 after the prompt's last token
    kept_positions: torch.Tensor  # [n] int64, the positions the kept tokens were prefilled at
    selection: Selection
    output: ForwardOutput  # the target's prefill forward, with any captured hidden states
    target_prefill_s: float

    def timings(self) -> dict[str, Any]:
        """PFlash fields for ``Timings.extra``."""
        return {"pflash_total_tokens": self.selection.total, "pflash_kept_tokens": self.selection.kept,
                "pflash_drafter_s": self.selection.drafter_s, "pflash_target_prefill_s": self.target_prefill_s}


@torch.inference_mode()
def compressed_prefill(target: Qwen35MoE, ids: torch.Tensor, *, drafter: Drafter, keep_ratio: float,
                       config: PFlashConfig = PFlashConfig(), reserve: int = 0,
                       capture_layers: Iterable[int] = ()) -> CompressedPrefill:
    """Select prompt tokens with ``drafter`` and prefill them into a fresh target state.

    ``ids`` [T] is the whole prompt; ``reserve`` is the KV room kept after the prompt (new
    tokens, plus a speculative block); ``capture_layers`` is passed to the target's forward
    (a speculative decoder's context features).
    """
    if reserve < 0:
        raise ConfigError(f"reserve must be >= 0 tokens, got {reserve}")
    if drafter.device != target.device:
        raise ConfigError(f"the drafter is on {drafter.device} but the target on {target.device}; "
                          "load both on one device")
    sel = pflash_select(drafter, ids, keep_ratio, config)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    t0 = time.perf_counter()
    state = target.new_state(sel.kept + reserve)
    out = target.forward(sel.kept_ids.to(target.device), state, positions=sel.kept_positions,
                         capture_layers=capture_layers, logits="last")
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    return CompressedPrefill(state=state, logits=out.logits[-1], kept_positions=sel.kept_positions,
                             selection=sel, output=out, target_prefill_s=time.perf_counter() - t0)
