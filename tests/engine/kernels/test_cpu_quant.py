"""CpuQuantMatrix against ``engine.gguf.quants.dequantize`` + a float64 matmul, on random valid
blocks whose scales vary block to block (a mix-up of groups, rows or planes shows), odd N
(padded to the kernel's multiple of 16) and odd M.

Bounds, relative to the largest reference output:
- int4 / int4x2 layouts in float32: 2e-6. The mapping is exact; only float32 accumulation
  (and the Q4_K/Q5_K zero, rounded once in float32) differ.
- the same in bfloat16 (the fast path): 1e-2. Activations, scales, zeros and outputs are
  rounded to bfloat16 (2**-9 relative each); about 4e-3 measured.
- int8 (per-row requantization, lossy): every output within ``sum_k |x_k| * max|w_row| / 254``
  (half a requantization step per weight), plus the bfloat16 allowance above in bfloat16.
- dequant (per-call fallback) in float32: 2e-6.
"""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from engine.gguf import quants
from engine.kernels.cpu_quant import CpuQuantMatrix

# fp16 fields of each block that hold scales: random bytes there could be inf or NaN
_SCALE_FIELDS = {Q.Q4_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
QTYPES = [Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q8_0, Q.Q6_K]
LAYOUT = {Q.Q4_0: "int4", Q.Q4_K: "int4", Q.Q5_K: "int4x2", Q.Q8_0: "int4x2", Q.Q6_K: "int8"}


def random_blocks(qtype, n, k, seed):
    """Uniform random codes and sub-block scales, with fp16 block scales drawn from [0.5, 2) * 1e-2."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, quants.tensor_nbytes(qtype, (n, k)), dtype=np.uint8).reshape(-1, size)
    for at in _SCALE_FIELDS[qtype]:
        scale = (rng.uniform(0.5, 2.0, blocks.shape[0]) * 1e-2).astype(np.float16)
        blocks[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def case(qtype, n, k, m, seed=0):
    raw = random_blocks(qtype, n, k, seed)
    w = quants.dequantize(raw, qtype, (n, k)).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    return raw, w, x, x.double() @ w.T


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def shapes(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    return [(37, block), (16, 2 * block), (5, 3 * block)] if block == 32 else [(37, 256), (16, 512), (3, 256)]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_float32_matches_dequantized_matmul(qtype, m):
    for i, (n, k) in enumerate(shapes(qtype)):
        raw, w, x, ref = case(qtype, n, k, m, seed=i)
        mat = CpuQuantMatrix.from_raw(raw, qtype, n, k, dtype=torch.float32)
        assert mat.layout == LAYOUT[qtype]
        out = mat.matmul(x)
        assert out.shape == (m, n) and out.dtype == torch.float32
        if mat.layout == "int8":
            bound = x.double().abs() @ (w.abs().amax(dim=1) / 254).expand(k, n)
            assert bool(((out.double() - ref).abs() <= bound * 1.001 + 1e-6).all())
            assert rel_err(out, ref) > 1e-6  # it is lossy, as documented
        else:
            assert rel_err(out, ref) < 2e-6, (n, k)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_fast_path_is_within_rounding(qtype, x_dtype):
    for i, (n, k) in enumerate(shapes(qtype)):
        raw, w, x, _ = case(qtype, n, k, 6, seed=10 + i)
        x = x.to(x_dtype)
        ref = x.double() @ w.T
        mat = CpuQuantMatrix.from_raw(raw, qtype, n, k)
        out = mat.matmul(x)
        assert out.dtype == x_dtype and out.shape == (6, n)
        err = rel_err(out, ref)
        if mat.layout == "int8":
            bound = x.double().abs() @ (w.abs().amax(dim=1) / 254).expand(k, n)
            assert bool(((out.double() - ref).abs() <= bound + 1e-2 * ref.abs().max()).all())
        else:
            assert err < 1e-2, (n, k, err)


@pytest.mark.parametrize("qtype", QTYPES + [Q.F32, Q.BF16], ids=lambda q: q.name)
def test_dequant_fallback_matches(qtype):
    n, k = shapes(qtype)[0] if qtype in QTYPES else (7, 40)
    if qtype in QTYPES:
        raw, w, x, ref = case(qtype, n, k, 4)
    else:
        values = torch.randn(n, k, generator=torch.Generator().manual_seed(3)).numpy()
        raw = quants.quantize(values, qtype)
        w = quants.dequantize(raw, qtype, (n, k)).double()
        x = torch.randn(4, k)
        ref = x.double() @ w.T
    layout = "dequant" if qtype in QTYPES else "auto"  # float types have no packed layout
    mat = CpuQuantMatrix.from_raw(raw, qtype, n, k, dtype=torch.float32, layout=layout)
    assert mat.layout == "dequant" and mat.nbytes == quants.tensor_nbytes(qtype, (n, k))
    assert rel_err(mat.matmul(x), ref) < 2e-6


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_int8_layout_serves_any_block_type(qtype):
    n, k = shapes(qtype)[1]
    raw, w, x, ref = case(qtype, n, k, 5, seed=7)
    mat = CpuQuantMatrix.from_raw(raw, qtype, n, k, dtype=torch.float32, layout="int8")
    bound = x.double().abs() @ (w.abs().amax(dim=1) / 254).expand(k, n)
    assert bool(((mat.matmul(x).double() - ref).abs() <= bound * 1.001 + 1e-6).all())


def test_packed_sizes():
    n, k = 64, 512
    q4 = CpuQuantMatrix.from_raw(random_blocks(Q.Q4_K, n, k, 0), Q.Q4_K, n, k)
    q8 = CpuQuantMatrix.from_raw(random_blocks(Q.Q8_0, n, k, 0), Q.Q8_0, n, k)
    q6 = CpuQuantMatrix.from_raw(random_blocks(Q.Q6_K, n, k, 0), Q.Q6_K, n, k)
    groups = n * k // 32
    assert q4.nbytes == n * k // 2 + groups * 2 * 2  # codes + bf16 (scale, zero) per group
    assert q8.nbytes == 2 * q4.nbytes  # two planes
    assert q6.nbytes == n * k + n * 2  # int8 codes + one bf16 scale per row
    assert max(q4.nbytes, q8.nbytes, q6.nbytes) < n * k * 2  # all below dense bf16
    odd = CpuQuantMatrix.from_raw(random_blocks(Q.Q4_0, 17, 64, 0), Q.Q4_0, 17, 64)
    assert odd.nbytes == 32 * 64 // 2 + 2 * 32 * 2 * 2  # rows padded to 32


def test_bad_input_is_one_clear_error():
    raw = random_blocks(Q.Q4_0, 16, 64, 0)
    with pytest.raises(ValueError, match="needs 576 bytes, got 575"):
        CpuQuantMatrix.from_raw(raw[:-1], Q.Q4_0, 16, 64)
    with pytest.raises(ValueError, match="layout 'int4x2' does not hold Q4_0"):
        CpuQuantMatrix.from_raw(raw, Q.Q4_0, 16, 64, layout="int4x2")
    with pytest.raises(ValueError, match="layout must be one of"):
        CpuQuantMatrix.from_raw(raw, Q.Q4_0, 16, 64, layout="int2")
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float32"):
        CpuQuantMatrix.from_raw(raw, Q.Q4_0, 16, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="not a multiple of the Q4_0 block size"):
        CpuQuantMatrix.from_raw(raw, Q.Q4_0, 36, 16)
    mat = CpuQuantMatrix.from_raw(raw, Q.Q4_0, 16, 64)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\], got \(3, 32\)"):
        mat.matmul(torch.randn(3, 32))
