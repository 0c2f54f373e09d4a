"""One weight matrix kept in its GGUF quantized form on the CPU, multiplied by torch's
weight-only kernels (the cold tier of the hybrid expert executor).

torch's CPU kernels take a weight ``w [N, K]`` in one of two forms:
  ``_weight_int4pack_mm_for_cpu``: 4-bit codes ``c`` with a scale ``s`` and zero ``z`` per group
  of 32 along K, ``w = (c - 8) * s + z``; N must be a multiple of 16.
  ``_weight_int8pack_mm``: int8 codes with one scale per row.

Layouts, from the GGUF codes ``q`` and block scales (``d``, ``dmin``, ``sc``, ``m``):
  int4    Q4_0 ``c = q, s = d, z = 0``; Q4_K ``c = q, s = d*sc, z = 8*s - dmin*m``. One plane.
  int4x2  two int4 planes summed, low nibble ``lo`` and high bits ``hi`` of the code.
          Q5_K: ``lo: (s, 8*s - dmin*m)``, ``hi + 8: (16*s, 0)``.
          Q8_0: with ``u = q + 128``, ``lo: (d, 8*d)``, ``hi: (16*d, 0)``.
  int8    any type, requantized per row: ``scale = max|w| / 127`` (lossy: adds up to half a
          step, ``max|w_row| / 254``, per weight). Q6_K lands here: its 16-wide sub-block scales
          have no 32-group form.
  dequant the raw blocks, dequantized on every call (float types, or where the kernels are absent).

The int4 layouts reproduce GGUF's dequantized weights exactly when scales are held in float32
(the zero of Q4_K/Q5_K is rounded once in float32). torch's fast CPU paths are the bfloat16 ones
(float32 falls back to a scalar loop tens of times slower), so ``dtype`` defaults to bfloat16:
scales, zeros, activations and outputs are then rounded to bfloat16 (relative 2**-9 each).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from engine.gguf import quants
from engine.gguf.quants import _f16, _k_scales, _nibbles

GROUP = 32  # K-group of the int4 kernel: the sub-block of Q4_0, Q4_K, Q5_K and Q8_0
LAYOUTS = ("auto", "int4", "int4x2", "int8", "dequant")
_NATIVE = {Q.Q4_0: "int4", Q.Q4_K: "int4", Q.Q5_K: "int4x2", Q.Q8_0: "int4x2", Q.Q6_K: "int8"}
_DTYPES = (torch.bfloat16, torch.float32)


def kernels_available() -> bool:
    """Whether this torch build has the CPU weight-only kernels the packed layouts need."""
    ops = torch.ops.aten
    return all(hasattr(ops, op) for op in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu",
                                           "_weight_int8pack_mm"))


@dataclass(frozen=True)
class _Int4Plane:
    packed: torch.Tensor  # uint8 [N16, K / 2], torch's tile order
    scales_zeros: torch.Tensor  # [K / 32, N16, 2] in the compute dtype


class CpuQuantMatrix:
    """``w [n, k]`` from GGUF blocks; ``matmul(x)`` is ``x @ w.T``. Build with ``from_raw``."""

    def __init__(self, *, layout: str, qtype: Q, n: int, k: int, dtype: torch.dtype,
                 planes: tuple[_Int4Plane, ...] = (), int8: tuple[torch.Tensor, torch.Tensor] | None = None,
                 raw: torch.Tensor | None = None):
        self.layout, self.qtype, self.n, self.k, self.dtype = layout, qtype, n, k, dtype
        self._planes = planes
        self._int8 = int8  # (codes int8 [n, k], scales [n])
        self._raw = raw  # uint8 blocks (dequant layout)

    @classmethod
    def from_raw(cls, raw: torch.Tensor | np.ndarray, qtype: Q, n: int, k: int, *,
                 dtype: torch.dtype = torch.bfloat16, layout: str = "auto") -> "CpuQuantMatrix":
        """Raw GGUF bytes of an ``[n, k]`` matrix (row-major blocks) -> the packed matrix.

        ``layout="auto"`` picks the type's native layout (see the module docstring), or
        ``dequant`` for float types and builds without the kernels.
        """
        qtype = Q(qtype)
        if qtype not in quants.SUPPORTED:
            raise ValueError(f"quant type {qtype.name} is not supported")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be bfloat16 or float32, got {dtype}")
        nbytes = quants.tensor_nbytes(qtype, (n, k))
        data = quants._as_uint8_tensor(raw)
        if data.numel() != nbytes:
            raise ValueError(f"{qtype.name} matrix [{n}, {k}] needs {nbytes} bytes, got {data.numel()}")
        if layout == "auto":
            layout = _NATIVE.get(qtype, "dequant") if kernels_available() else "dequant"
        if layout in ("int4", "int4x2") and _NATIVE.get(qtype) != layout:
            raise ValueError(f"layout {layout!r} does not hold {qtype.name} "
                             f"(it holds {', '.join(t.name for t, lay in _NATIVE.items() if lay == layout)})")
        if layout == "int8" and k % GROUP:
            raise ValueError(f"layout 'int8' needs k to be a multiple of {GROUP}, got {k}")
        common = dict(layout=layout, qtype=qtype, n=n, k=k, dtype=dtype)
        if layout == "dequant":
            return cls(**common, raw=data.clone())
        if layout == "int8":
            w = quants.dequantize(data, qtype, (n, k))
            scale = w.abs().amax(dim=1) / 127
            codes = torch.round(w / torch.where(scale > 0, scale, 1)[:, None]).clamp_(-127, 127).to(torch.int8)
            return cls(**common, int8=(codes, scale.to(dtype)))
        blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
        planes = tuple(_pack_int4(codes, s, z, n, k, dtype) for codes, s, z in _PLANES[qtype](blocks))
        return cls(**common, planes=planes)

    @property
    def nbytes(self) -> int:
        """Host memory held by this matrix."""
        tensors = [t for p in self._planes for t in (p.packed, p.scales_zeros)]
        tensors += list(self._int8 or ()) + ([self._raw] if self._raw is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, k] float (CPU) -> x @ w.T [M, n] in x's dtype (computed in ``self.dtype``)."""
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x must be [M, {self.k}], got {tuple(x.shape)}")
        if x.device.type != "cpu":
            raise ValueError(f"x must be on the CPU, got {x.device}")
        xc = x.to(self.dtype).contiguous()
        if self._raw is not None:
            y = F.linear(xc, quants.dequantize(self._raw, self.qtype, (self.n, self.k)).to(self.dtype))
        elif self._int8 is not None:
            y = torch.ops.aten._weight_int8pack_mm(xc, *self._int8)
        else:
            y = None
            for p in self._planes:
                part = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, p.packed, GROUP, p.scales_zeros)
                y = part if y is None else y.add_(part)
            y = y[:, :self.n]
        return y.to(x.dtype)

    def __repr__(self) -> str:
        return (f"CpuQuantMatrix({self.qtype.name} [{self.n}, {self.k}], layout={self.layout!r}, "
                f"dtype={self.dtype}, nbytes={self.nbytes})")


Plane = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [n, k] in 0..15, s and z [n, k / 32] float32


def _planes_q4_0(b: torch.Tensor) -> list[Plane]:
    codes = _nibbles(b[:, 2:], 1, 16)  # [nb, 2, 16]: elements 0..15 then 16..31
    d = _f16(b[:, 0:2])  # [nb, 1]
    return [(codes, d, torch.zeros_like(d))]


def _k_scale_min(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: per 32-wide sub-block scale ``d*sc`` and offset ``dmin*m``, float32 [nb, 8]."""
    sc, mn = _k_scales(b[:, 4:16])
    return _f16(b[:, 0:2]) * sc, _f16(b[:, 2:4]) * mn


def _planes_q4_k(b: torch.Tensor) -> list[Plane]:
    s, dm = _k_scale_min(b)
    return [(_nibbles(b[:, 16:144], 4), s, 8 * s - dm)]


def _planes_q5_k(b: torch.Tensor) -> list[Plane]:
    s, dm = _k_scale_min(b)
    qh = b[:, 16:48]  # bit j of qh[l]: the fifth bit of sub-block j's element l
    hi = torch.stack([(qh >> j) & 1 for j in range(8)], dim=1)  # [nb, 8, 32]
    return [(_nibbles(b[:, 48:176], 4), s, 8 * s - dm), (hi + 8, 16 * s, torch.zeros_like(s))]


def _planes_q8_0(b: torch.Tensor) -> list[Plane]:
    d = _f16(b[:, 0:2])  # [nb, 1]
    u = (b[:, 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)  # q + 128 in 0..255
    return [(u & 15, d, 8 * d), (u >> 4, 16 * d, torch.zeros_like(d))]


_PLANES = {Q.Q4_0: _planes_q4_0, Q.Q4_K: _planes_q4_k, Q.Q5_K: _planes_q5_k, Q.Q8_0: _planes_q8_0}


def _pack_int4(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor, n: int, k: int,
               dtype: torch.dtype) -> _Int4Plane:
    """Codes [.., 32-runs] in row-major block order, s/z [.., groups] -> one kernel-ready plane.

    N is padded to a multiple of 16 with rows whose scale and zero are 0."""
    n16 = -(-n // 16) * 16
    c = torch.full((n16, k), 8, dtype=torch.int32)
    c[:n] = codes.reshape(n, k)
    sz = torch.zeros(k // GROUP, n16, 2, dtype=torch.float32)
    sz[:, :n, 0] = s.reshape(n, k // GROUP).T
    sz[:, :n, 1] = z.reshape(n, k // GROUP).T
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c, 1)
    return _Int4Plane(packed=packed, scales_zeros=sz.to(dtype))
