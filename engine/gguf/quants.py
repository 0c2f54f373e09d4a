"""GGML block formats: torch dequantizers, numpy quantizers and random valid blocks.

Layouts follow ggml's ``block_*`` structs (little-endian, fp16 scales). Every function works
on whole arrays of blocks at once; nothing loops over blocks in Python.
"""

from __future__ import annotations

import math
from typing import Sequence

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

QK_K = 256
SUPPORTED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)

# Standard deviation of the integer codes when every code is equally likely.
_Q4_STD = float(np.arange(16).std())
_Q5_STD = float(np.arange(32).std())
_Q6_STD = float(np.arange(64).std())
_Q8_STD = float(np.arange(-128, 128).std())


def _check_type(qtype: Q) -> Q:
    qtype = Q(qtype)
    if qtype not in SUPPORTED:
        names = ", ".join(t.name for t in SUPPORTED)
        raise ValueError(f"quant type {qtype.name} is not supported (supported: {names})")
    return qtype


def tensor_nbytes(qtype: Q, shape: Sequence[int]) -> int:
    """Bytes of a tensor of ``shape`` (torch order: rows are the last dimension) in ``qtype``."""
    qtype = _check_type(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    if not shape or any(int(d) <= 0 for d in shape):
        raise ValueError(f"tensor shape {tuple(shape)} must have positive dimensions")
    if int(shape[-1]) % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the {qtype.name} block size {block}")
    return math.prod(int(d) for d in shape) // block * size


def _as_uint8_tensor(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(raw, np.ndarray):
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if not raw.flags.writeable:
            raw = raw.copy()
        return torch.from_numpy(raw)
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw tensor data must be uint8, got {raw.dtype}")
    return raw.contiguous().reshape(-1)


def _f16(col: torch.Tensor) -> torch.Tensor:
    """fp16 stored in two bytes per block, as float32 [n, 1]."""
    return col.contiguous().view(torch.float16).float()


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12-byte 6-bit scales and mins of Q4_K/Q5_K -> two [n, 8] float tensors.

    Works on the three little-endian 32-bit words at once: four bytes per operation.
    """
    w = s.contiguous().view(torch.int32)  # [n, 3]: scale lows, min lows, high nibbles
    d, m, md = w[:, 0], w[:, 1], w[:, 2]
    sc = torch.stack([d & 0x3F3F3F3F, (md & 0x0F0F0F0F) | ((d >> 2) & 0x30303030)], dim=1)
    mn = torch.stack([m & 0x3F3F3F3F, ((md >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030)], dim=1)
    return sc.view(torch.uint8).float(), mn.view(torch.uint8).float()


def _nibbles(qs: torch.Tensor, groups: int, run: int = 32) -> torch.Tensor:
    """[n, groups*run] bytes -> [n, 2*groups, run] codes: low nibbles of each run, then high."""
    n = qs.shape[0]
    qs = qs.reshape(n, groups, run)
    out = torch.empty(n, groups, 2, run, dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 15, out=out[:, :, 0])
    torch.bitwise_right_shift(qs, 4, out=out[:, :, 1])
    return out.reshape(n, 2 * groups, run)


def _scaled(q: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """float(q) * scale - shift, in place on one float32 buffer (same rounding as gguf-py)."""
    out = q.float()
    out.mul_(scale)
    if shift is not None:
        out.sub_(shift)
    return out


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:
    return _scaled(b[:, 2:].view(torch.int8), _f16(b[:, 0:2]))


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 1, 16).reshape(-1, 32).view(torch.int8) - 8
    return _scaled(q, _f16(b[:, 0:2]))


def _deq_q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).reshape(n, 8, 1)
    return _scaled(_nibbles(b[:, 16:144], 4), d, dm).reshape(n, QK_K)


def _deq_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).reshape(n, 8, 1)
    q = _nibbles(b[:, 48:176], 4)
    qh = b[:, 16:48]
    for j in range(8):  # bit j of qh[l] is the fifth bit of sub-block j's element l
        q[:, j] |= ((qh >> j) & 1) << 4
    return _scaled(q, d, dm).reshape(n, QK_K)


def _deq_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = _nibbles(b[:, 0:128], 4).reshape(n, 2, 2, 2, 32)  # [half, nibble, run, l]
    q = q.transpose(2, 3).reshape(n, 2, 4, 32)  # [half, group = 2*nibble + run, l]
    qh = b[:, 128:192].reshape(n, 2, 32)
    for g in range(4):
        q[:, :, g] |= ((qh >> (2 * g)) & 3) << 4
    q = (q.view(torch.int8) - 32).reshape(n, 16, 16)
    d = (_f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    return _scaled(q, d).reshape(n, QK_K)


_BLOCK_DEQUANT = {Q.Q8_0: _deq_q8_0, Q.Q4_0: _deq_q4_0, Q.Q4_K: _deq_q4_k, Q.Q5_K: _deq_q5_k,
                  Q.Q6_K: _deq_q6_k}


def dequantize(raw: torch.Tensor | np.ndarray, qtype: Q, shape: Sequence[int]) -> torch.Tensor:
    """Raw bytes of a tensor -> float32 tensor of ``shape``, on the device ``raw`` lives on."""
    qtype = _check_type(qtype)
    shape = tuple(int(d) for d in shape)
    nbytes = tensor_nbytes(qtype, shape)
    data = _as_uint8_tensor(raw)
    if data.numel() != nbytes:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {nbytes} bytes, got {data.numel()}")
    if qtype == Q.F32:
        out = data.view(torch.float32)
    elif qtype == Q.F16:
        out = data.view(torch.float16).float()
    elif qtype == Q.BF16:
        out = data.view(torch.bfloat16).float()
    else:
        size = GGML_QUANT_SIZES[qtype][1]
        out = _BLOCK_DEQUANT[qtype](data.reshape(-1, size))
    return out.reshape(shape)


def _fp16_at_least(x: np.ndarray) -> np.ndarray:
    """Round non-negative float32 scales to fp16, upwards, so a range never clips."""
    h = x.astype(np.float16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    if not np.all(np.isfinite(h)):
        raise ValueError("values are too large for the fp16 block scales of this quant type")
    return h


def _ceil_div(a: np.ndarray, b: np.ndarray, top: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(b > 0, np.ceil(a / np.where(b > 0, b, 1)), 0)
    return np.clip(q, 0, top).astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Two [n, 8] arrays of 6-bit values -> [n, 12] bytes (inverse of ``_k_scales``)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] 4-bit codes -> [n, 128] bytes: sub-block 2c in low nibbles, 2c+1 in high."""
    n = q.shape[0]
    q = q.reshape(n, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)


def _affine_k(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Min/max encoder shared by Q4_K and Q5_K: 8 sub-blocks of 32, value = d*sc*q - dmin*m."""
    xs = x.reshape(-1, 8, 32)
    offset = -np.minimum(xs.min(axis=2), 0)  # [n, 8], >= 0
    dmin = _fp16_at_least(offset.max(axis=1, keepdims=True) / 63)
    m = _ceil_div(offset, dmin.astype(np.float32), 63)
    low = dmin.astype(np.float32) * m  # [n, 8]
    step = (xs.max(axis=2) + low) / levels
    d = _fp16_at_least(step.max(axis=1, keepdims=True) / 63)
    sc = _ceil_div(step, d.astype(np.float32), 63)
    scale = (d.astype(np.float32) * sc)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.rint((xs + low[:, :, None]) / np.where(scale > 0, scale, 1)), 0)
    q = np.clip(q, 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 15)
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_k_scales(sc, m),
                           _pack_nibbles(q)], axis=1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 31)
    bits = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = np.bitwise_or.reduce(bits, axis=1)  # [n, 32]: bit j is sub-block j's fifth bit
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_k_scales(sc, m),
                           qh, _pack_nibbles(q & 15)], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    step = np.abs(xs).max(axis=2) / 31  # [n, 16]
    d = _fp16_at_least(step.max(axis=1, keepdims=True) / 127)
    sc = _ceil_div(step, d.astype(np.float32), 127)
    scale = (d.astype(np.float32) * sc)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.rint(xs / np.where(scale > 0, scale, 1)), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    lo, hi = q & 15, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                           d.view(np.uint8)], axis=1)


_K_QUANTIZE = {Q.Q4_K: _quantize_q4_k, Q.Q5_K: _quantize_q5_k, Q.Q6_K: _quantize_q6_k}


def quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 values (rows along the last axis) -> flat uint8 bytes in ``qtype``'s layout."""
    qtype = _check_type(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0:
        x = x.reshape(1)
    tensor_nbytes(qtype, x.shape)
    if not np.all(np.isfinite(x)):
        raise ValueError("cannot quantize non-finite values")
    if qtype == Q.F32:
        return x.reshape(-1).view(np.uint8)
    if qtype in _K_QUANTIZE:
        return _K_QUANTIZE[qtype](x.reshape(-1, QK_K)).reshape(-1)
    out = gguf.quants.quantize(x.reshape(-1, x.shape[-1]), qtype)
    return np.ascontiguousarray(out).reshape(-1).view(np.uint8)


def _header(qtype: Q, std: float) -> np.ndarray:
    """Scale bytes shared by every random block: codes times these scales have std ~ ``std``."""
    if qtype == Q.Q8_0:
        return np.array([std / _Q8_STD], dtype=np.float16).view(np.uint8)
    if qtype == Q.Q4_0:
        return np.array([std / _Q4_STD], dtype=np.float16).view(np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):
        half = 7.5 if qtype == Q.Q4_K else 15.5  # the mean code, cancelled by the min
        code_std = _Q4_STD if qtype == Q.Q4_K else _Q5_STD
        sc = np.full((1, 8), 60, dtype=np.uint8)
        m = np.full((1, 8), round(60 * half / 16), dtype=np.uint8)
        d = np.float16(std / code_std / 60)
        dmin = np.float16(float(d) * 60 * half / float(m[0, 0]))
        return np.concatenate([np.array([d, dmin], dtype=np.float16).view(np.uint8),
                               _pack_k_scales(sc, m)[0]])
    if qtype == Q.Q6_K:
        return np.concatenate([np.full(16, 64, dtype=np.int8).view(np.uint8),
                               np.array([std / _Q6_STD / 64], dtype=np.float16).view(np.uint8)])
    raise ValueError(f"no random block layout for {qtype.name}")


_HEADER_AT = {Q.Q8_0: slice(0, 2), Q.Q4_0: slice(0, 2), Q.Q4_K: slice(0, 16), Q.Q5_K: slice(0, 16),
              Q.Q6_K: slice(192, 210)}


def random_quantized(shape: Sequence[int], qtype: Q, rng: np.random.Generator, std: float) -> np.ndarray:
    """Random valid bytes of a ``qtype`` tensor whose values have roughly standard deviation ``std``.

    Quant codes are uniform random bytes; block scales are fixed so that no value needs
    computing, which keeps writing a large model bound by the disk.
    """
    qtype = _check_type(qtype)
    if not std > 0:
        raise ValueError(f"std must be positive, got {std}")
    nbytes = tensor_nbytes(qtype, shape)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        values = rng.standard_normal(nbytes // {Q.F32: 4, Q.F16: 2, Q.BF16: 2}[qtype], dtype=np.float32)
        values *= np.float32(std)
        return quantize(values.reshape(-1, int(shape[-1])), qtype)
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes].reshape(-1, size)
    blocks[:, _HEADER_AT[qtype]] = _header(qtype, std)
    return blocks.reshape(-1)
