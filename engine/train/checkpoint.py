"""Resumable training checkpoints: one file per model, replaced atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from engine.errors import ConfigError

FILE_NAME = "last.pt"

# Fields that must match for a checkpoint to continue the same run.
RUN_IDENTITY = ("shape", "vocab", "seed", "batch_tokens", "curriculum", "example_share", "lr")


def checkpoint_path(ckpt_dir: Path, name: str) -> Path:
    return ckpt_dir / name / FILE_NAME


def save_checkpoint(path: Path, state: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(dict(state), tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: Path, identity: Mapping[str, Any]) -> dict[str, Any]:
    """The saved state, after checking it belongs to the run ``identity`` describes."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no checkpoint to resume from") from None
    except Exception as exc:  # a truncated or foreign file
        raise ConfigError(f"{path}: not a readable training checkpoint ({type(exc).__name__})") from None
    saved = state.get("identity", {})
    for key in RUN_IDENTITY:
        if saved.get(key) != identity.get(key):
            raise ConfigError(f"{path}: checkpoint field {key!r} is {saved.get(key)!r}, but this run has "
                              f"{identity.get(key)!r}")
    return state
