"""Projections whose weight is either a dense tensor or a quantized matrix kept as GGUF blocks.

Dense float32 projections of ``skinny_min_rows()`` (2 by default) to 32 rows on CUDA (DFlash verify and draft
blocks) take the one-launch kernels of ``engine.kernels.skinny``; everything else ``F.linear``.
``LUCE_TUNE_SKINNY_MIN_ROWS`` (1-32) moves the lower bound: 8 leaves blocks of 2-7 rows to cuBLAS, 1 sends a
decode step's single row to the kernel too.
"""

from __future__ import annotations

import os
from typing import Union

import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.kernels import fused
from engine.kernels.quant import QuantMatrix

Weight = Union[torch.Tensor, QuantMatrix]

# None: ``linear`` takes the few-row kernel where it applies (CUDA); True: off CUDA too (tests, with
# TRITON_INTERPRET=1); False: never (``LUCE_TUNE_SKINNY=0``, for measuring what it changes).
FUSED_SKINNY: bool | None = False if os.environ.get("LUCE_TUNE_SKINNY", "1") == "0" else None
SKINNY = "few-row float32 projection"
SKINNY_MIN_ROWS_ENV = "LUCE_TUNE_SKINNY_MIN_ROWS"
MAX_ROWS = 32  # engine.kernels.skinny.MAX_M, without importing Triton here
# blocks of 2-7 rows (a verify block at spec_len 4, a draft block of 4) take the kernel's few-row form
# (``skinny.rows_linear``): on an H100 a DFlash step at spec_len 4 took 523 us against 698 us through cuBLAS
# (docs/benchmarks.md, fourteenth round). A decode step's single row stays with cuBLAS's GEMV unless told
# (1): not measured in a whole step.
DEFAULT_MIN_ROWS = 2


def skinny_min_rows() -> int:
    """The fewest rows ``linear`` sends to the few-row kernels: ``LUCE_TUNE_SKINNY_MIN_ROWS``, else
    ``DEFAULT_MIN_ROWS``."""
    text = os.environ.get(SKINNY_MIN_ROWS_ENV, "").strip()
    if not text:
        return DEFAULT_MIN_ROWS
    try:
        rows = int(text)
    except ValueError:
        rows = 0
    if not 1 <= rows <= MAX_ROWS:
        raise ConfigError(f"{SKINNY_MIN_ROWS_ENV} must be a whole number of rows from 1 to {MAX_ROWS}, got {text!r}")
    return rows


_MIN_ROWS: int | None = None  # read once, at the first float32 call that could take the kernel


def _skinny(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    on = (x.is_cuda and fused.allowed(SKINNY)) if FUSED_SKINNY is None else FUSED_SKINNY
    if not on or x.dtype != torch.float32:  # bf16 models never take it: no import, no checks
        return None
    global _MIN_ROWS
    from engine.kernels import skinny

    if _MIN_ROWS is None:
        rows = skinny_min_rows()
        skinny.rows_tiles()  # a bad LUCE_TUNE_ROWS_TILE or LUCE_TUNE_FEW_ROWS is one clear error here, at every
        skinny.few_rows()  # call, not a kernel turned off
        _MIN_ROWS = rows

    if not skinny.applies(x, w, min_rows=_MIN_ROWS):
        return None
    return fused.attempt(SKINNY, FUSED_SKINNY, lambda: skinny.skinny_linear(x, w))


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """``x @ w.T`` over the last dimension of ``x``, for a dense or a quantized ``w``."""
    if isinstance(w, QuantMatrix):
        flat = x.reshape(-1, x.shape[-1])
        return w.matmul(flat.contiguous()).view(*x.shape[:-1], w.n)
    out = _skinny(x, w)
    return F.linear(x, w) if out is None else out
