"""Checks shared by the Triton kernels' tile configurations."""

from __future__ import annotations

from typing import Mapping, Sequence


def check_tiles(config: object, least: Mapping[str, int], warps: Sequence[str]) -> None:
    """Each field in ``least`` a power of two at least that large (tensor-core dots need 16);
    each field in ``warps`` a power of two. One ValueError naming the first bad field."""
    for name, smallest in least.items():
        value = getattr(config, name)
        if value < smallest or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {smallest}, got {value}")
    for name in warps:
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
