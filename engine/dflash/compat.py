"""Whether a DFlash draft can serve a target, decided from metadata before any tensor loads.

A draft built for another model (the dense 27B's drafter, hidden 5120, against the 35B-A3B
MoE, hidden 2048) must be refused at once with both sides' values, never loaded into a
server that then hangs on mismatched shapes.
"""

from __future__ import annotations

from pathlib import Path

from engine.dflash.draft import DraftConfig
from engine.dflash.gguf_io import DraftFile
from engine.errors import ConfigError, IncompatibleModelError
from engine.model.config import ModelConfig


def check_compatible(draft: DraftConfig, target: ModelConfig, *, draft_name: str, target_name: str) -> None:
    """Raise IncompatibleModelError on the first property the draft and the target disagree on."""
    d, t = f"draft {draft_name}", f"target {target_name}"
    if draft.hidden != target.hidden:
        raise IncompatibleModelError(f"{d} has hidden size {draft.hidden} but {t} has {target.hidden}")
    if draft.vocab and draft.vocab != target.vocab:
        raise IncompatibleModelError(f"{d} has a vocabulary of {draft.vocab} tokens but {t} has {target.vocab}")
    if not 0 <= draft.mask_token_id < target.vocab:
        raise IncompatibleModelError(f"{d} uses mask token id {draft.mask_token_id}, outside the vocabulary "
                                     f"of {t} ({target.vocab} tokens)")
    outside = [i for i in draft.target_layer_ids if i >= target.n_layers]
    if outside:
        raise IncompatibleModelError(
            f"{d} reads target layers {list(draft.target_layer_ids)} but {t} has {target.n_layers} layers "
            f"(ids 0..{target.n_layers - 1})")


def check_spec_len(spec_len: int, draft: DraftConfig) -> None:
    """``spec_len`` tokens are verified per step: the last committed one plus ``spec_len - 1`` drafted."""
    if not 2 <= spec_len <= draft.block_size:
        raise ConfigError(f"spec_len must be between 2 and the draft's block size {draft.block_size}, got {spec_len}")


def open_compatible(draft_path: str | Path, target: ModelConfig, *, target_name: str) -> DraftFile:
    """Open a draft's metadata and check it against the target; load its tensors afterwards."""
    draft = DraftFile.open(draft_path)
    check_compatible(draft.cfg, target, draft_name=Path(draft_path).name, target_name=target_name)
    return draft
