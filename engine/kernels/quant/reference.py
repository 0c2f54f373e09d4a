"""Matmuls against GGUF-quantized weights that stay in their ggml block layout.

``QuantMatrix`` holds one [N, K] weight as raw bytes, one row of blocks per output row;
``QuantExperts`` holds the [E, N, K] experts of one layer the same way. The references
dequantize with ``engine.gguf.quants`` and multiply in float32; the Triton kernels beside
this file read the same bytes and must agree with them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from engine.gguf.quants import dequantize

QTYPES = (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
IMPLS = ("auto", "triton", "torch")
LAYOUTS = ("ggml", "split")
SPLIT_QTYPES = (Q.Q4_0, Q.Q8_0)  # one fp16 scale and the codes per 32-weight block


def resolve_impl(impl: str, device: torch.device) -> str:
    """``auto`` means the Triton kernels on CUDA and torch elsewhere."""
    if impl not in IMPLS:
        raise ValueError(f"quantized matmul implementation must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return impl


def check_qtype(qtype: Q | int) -> Q:
    try:
        qtype = Q(qtype)
    except ValueError:
        qtype = None
    if qtype not in QTYPES:
        raise ValueError(f"quantized matmul supports {', '.join(t.name for t in QTYPES)}, got {qtype!r}")
    return qtype


def row_bytes(qtype: Q, k: int) -> int:
    """Bytes of one row of ``k`` values; ``k`` must be a whole number of blocks."""
    block, size = GGML_QUANT_SIZES[qtype]
    if k <= 0 or k % block:
        raise ValueError(f"row length {k} must be a positive multiple of the {qtype.name} block size {block}")
    return k // block * size


def _as_bytes(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8).copy())
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw weight bytes must be a uint8 tensor, got {raw.dtype}")
    return raw


def _check_x(x: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a float tensor, got {x.dtype}")


def _shaped(raw: torch.Tensor | np.ndarray, qtype: Q, lead: tuple[int, ...], k: int) -> torch.Tensor:
    """Raw bytes -> uint8 [*lead, row_bytes], checking the byte count."""
    raw = _as_bytes(raw)
    rb = row_bytes(qtype, k)
    want = int(np.prod(lead)) * rb
    if raw.numel() != want:
        raise ValueError(f"{qtype.name} weight {(*lead, k)} needs {want} bytes, got {raw.numel()}")
    return raw.reshape(*lead, rb)


def split_rows(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Q4_0/Q8_0 rows ``raw`` [n, row_bytes] from ggml's block order (scale, codes; scale,
    codes; ...) to the split layout: every block's codes in order, then every block's fp16 scale.
    The same bytes and row length, rearranged on ``raw``'s device; ``join_rows`` undoes it.
    The codes then start at the row (16-byte aligned where the row is), so a kernel loads each
    block's codes as one vector instead of byte by byte from an odd offset."""
    _, size = GGML_QUANT_SIZES[check_split(qtype)]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, size)
    return torch.cat([blocks[:, :, 2:].reshape(n, -1), blocks[:, :, :2].reshape(n, -1)], dim=1)


def join_rows(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """The inverse of ``split_rows``: ggml's block order."""
    _, size = GGML_QUANT_SIZES[check_split(qtype)]
    n = raw.shape[0]
    nb = raw.shape[1] // size
    codes = raw[:, :nb * (size - 2)].reshape(n, nb, size - 2)
    scales = raw[:, nb * (size - 2):].reshape(n, nb, 2)
    return torch.cat([scales, codes], dim=2).reshape(n, -1)


def split_layout_on(device: torch.device | str) -> bool:
    """Whether weights loaded for ``device`` take the split layout: on CUDA, unless the
    environment sets ``LUCE_TUNE_SPLIT_LAYOUT=0`` (the kernels then read ggml's block order)."""
    return torch.device(device).type == "cuda" and os.environ.get("LUCE_TUNE_SPLIT_LAYOUT", "1") != "0"


def check_split(qtype: Q) -> Q:
    if qtype not in SPLIT_QTYPES:
        raise ValueError(f"the split layout holds {', '.join(t.name for t in SPLIT_QTYPES)}, not {Q(qtype).name}")
    return qtype


@dataclass(frozen=True)
class QuantMatrix:
    """A [n, k] weight as raw ggml blocks: ``raw`` uint8 [n, row_bytes].

    ``layout`` "ggml" keeps the file's block order; "split" (Q4_0 and Q8_0, ``split_rows``)
    the same bytes with each row's codes first and its scales after them, which the Triton
    kernels read with vector loads. The references dequantize either."""

    raw: torch.Tensor
    qtype: Q
    n: int
    k: int
    layout: str = "ggml"

    def __post_init__(self) -> None:
        object.__setattr__(self, "qtype", check_qtype(self.qtype))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "split":
            check_split(self.qtype)
        if self.n <= 0:
            raise ValueError(f"row count n must be positive, got {self.n}")
        rb = row_bytes(self.qtype, self.k)
        if self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != (self.n, rb):
            raise ValueError(f"{self.qtype.name} weight [{self.n}, {self.k}] needs uint8 raw [{self.n}, {rb}], "
                             f"got {self.raw.dtype} {tuple(self.raw.shape)}")
        if not self.raw.is_contiguous():
            raise ValueError("raw weight bytes must be contiguous")

    @classmethod
    def from_gguf_bytes(cls, raw: torch.Tensor | np.ndarray, qtype: Q | int, n: int, k: int) -> "QuantMatrix":
        """From the bytes of a GGUF tensor of torch shape [n, k] (flat or already [n, row_bytes])."""
        qtype = check_qtype(qtype)
        return cls(_shaped(raw, qtype, (n,), k).contiguous(), qtype, n, k)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def split_at(self) -> int:
        """Byte offset of the scales in a split-layout row; 0 for the ggml layout."""
        return self.k // 32 * (GGML_QUANT_SIZES[self.qtype][1] - 2) if self.layout == "split" else 0

    @property
    def ggml_raw(self) -> torch.Tensor:
        """The blocks in ggml's order (``raw`` itself, or the split rows joined back)."""
        return self.raw if self.layout == "ggml" else join_rows(self.raw, self.qtype)

    def to(self, device: torch.device | str) -> "QuantMatrix":
        return replace(self, raw=self.raw.to(device))

    def with_layout(self, layout: str) -> "QuantMatrix":
        """The same matrix in ``layout`` (a rearranged copy, or ``self``)."""
        if layout == self.layout:
            return self
        raw = split_rows(self.raw, self.qtype) if layout == "split" else self.ggml_raw
        return replace(self, raw=raw.contiguous(), layout=layout)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.ggml_raw, self.qtype, (self.n, self.k)).to(dtype)

    def matmul(self, x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        """``x @ W.T`` [M, n] in x.dtype: Triton on CUDA (or with ``impl="triton"``), torch otherwise."""
        if resolve_impl(impl, x.device) == "triton":
            from engine.kernels.quant.triton import qmatmul

            return qmatmul(x, self)
        return qmatmul_reference(x, self.ggml_raw, self.qtype, self.n, self.k)


@dataclass(frozen=True)
class QuantExperts:
    """The [e, n, k] experts of one layer as raw ggml blocks: ``raw`` uint8 [e, n, row_bytes],
    each row in ``layout`` "ggml" or "split" (as ``QuantMatrix``)."""

    raw: torch.Tensor
    qtype: Q
    e: int
    n: int
    k: int
    layout: str = "ggml"

    def __post_init__(self) -> None:
        object.__setattr__(self, "qtype", check_qtype(self.qtype))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "split":
            check_split(self.qtype)
        if self.e <= 0 or self.n <= 0:
            raise ValueError(f"expert count e and row count n must be positive, got {self.e} and {self.n}")
        rb = row_bytes(self.qtype, self.k)
        if self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != (self.e, self.n, rb):
            raise ValueError(f"{self.qtype.name} experts [{self.e}, {self.n}, {self.k}] need uint8 raw "
                             f"[{self.e}, {self.n}, {rb}], got {self.raw.dtype} {tuple(self.raw.shape)}")
        if not self.raw.is_contiguous():
            raise ValueError("raw expert bytes must be contiguous")

    @classmethod
    def from_gguf_bytes(cls, raw: torch.Tensor | np.ndarray, qtype: Q | int, e: int, n: int, k: int
                        ) -> "QuantExperts":
        qtype = check_qtype(qtype)
        return cls(_shaped(raw, qtype, (e, n), k).contiguous(), qtype, e, n, k)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def to(self, device: torch.device | str) -> "QuantExperts":
        return replace(self, raw=self.raw.to(device))

    @property
    def split_at(self) -> int:
        """Byte offset of the scales in a split-layout row; 0 for the ggml layout."""
        return self.k // 32 * (GGML_QUANT_SIZES[self.qtype][1] - 2) if self.layout == "split" else 0

    @property
    def ggml_raw(self) -> torch.Tensor:
        """The blocks in ggml's order, [e, n, row_bytes]."""
        if self.layout == "ggml":
            return self.raw
        return join_rows(self.raw.reshape(self.e * self.n, -1), self.qtype).reshape(self.raw.shape)

    def with_layout(self, layout: str) -> "QuantExperts":
        """The same experts in ``layout`` (a rearranged copy, or ``self``)."""
        if layout == self.layout:
            return self
        raw = (split_rows(self.raw.reshape(self.e * self.n, -1), self.qtype).reshape(self.raw.shape)
               if layout == "split" else self.ggml_raw)
        return replace(self, raw=raw.contiguous(), layout=layout)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.ggml_raw, self.qtype, (self.e, self.n, self.k)).to(dtype)

    def matmul(self, x: torch.Tensor, ids: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        """Row t of the [T, n] result is ``W[ids[t]] @ x[t]`` (zero where ``ids[t] < 0``), in x.dtype."""
        if resolve_impl(impl, x.device) == "triton":
            from engine.kernels.quant.triton import qmatmul_experts

            return qmatmul_experts(x, self, ids)
        return qmatmul_experts_reference(x, self.ggml_raw, ids, self.qtype, self.n, self.k)


def qmatmul_reference(x: torch.Tensor, raw: torch.Tensor | np.ndarray, qtype: Q | int, n: int, k: int
                      ) -> torch.Tensor:
    """``x @ dequantize(raw).T`` [M, n] in x.dtype, computed in float32.

    x [M, k] float; raw the GGUF bytes of an [n, k] weight (flat or [n, row_bytes]).
    """
    qtype = check_qtype(qtype)
    _check_x(x, k)
    w = dequantize(_shaped(raw, qtype, (n,), k).to(x.device), qtype, (n, k))  # [n, k] float32
    return (x.float() @ w.T).to(x.dtype)


def qmatmul_experts_reference(x: torch.Tensor, raw: torch.Tensor | np.ndarray, ids: torch.Tensor,
                              qtype: Q | int, n: int, k: int) -> torch.Tensor:
    """Row t is ``dequantize(raw)[ids[t]] @ x[t]`` [T, n] in x.dtype (zero where ``ids[t] < 0``).

    x [T, k] float; raw the bytes of [E, n, k] experts (flat or [E, n, row_bytes]); ids [T] int.
    """
    qtype = check_qtype(qtype)
    _check_x(x, k)
    raw = _as_bytes(raw)
    e = raw.numel() // max(n * row_bytes(qtype, k), 1)
    raw = _shaped(raw, qtype, (e, n), k).to(x.device)
    if ids.shape != (x.shape[0],) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be an int tensor [{x.shape[0]}], got {ids.dtype} {tuple(ids.shape)}")
    out = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    for expert in torch.unique(ids[ids >= 0]).tolist():
        if expert >= e:
            raise ValueError(f"expert id {expert} is out of range for {e} experts")
        rows = (ids == expert).nonzero(as_tuple=True)[0]
        w = dequantize(raw[expert], qtype, (n, k))  # [n, k]
        out[rows] = x[rows].float() @ w.T
    return out.to(x.dtype)
