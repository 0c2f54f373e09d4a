"""Quantized matmul kernels against their torch references: odd shapes on the CPU (Triton
interpreter), the real Qwen3.6-35B-A3B shapes on CUDA.

Weights come from two generators: ``quantize`` of random floats whose magnitude varies per
group of 16 (so block scales and mins differ everywhere), and random bytes with random fp16
scales and random 6-bit scale bytes (every bit pattern of the packed scales). The reference
itself is checked against gguf-py's numpy dequantizer, which anchors the byte layouts.

Errors are the largest absolute difference over the reference's largest output. fp32 x must
agree to 1e-5 (the dequantized values are formed the same way; only summation order differs);
fp16/bf16 x get 5e-3/2e-2 for the GEMM path (tiles rounded to x's dtype for the dot) and the
rounding of the output to x's dtype. The interpreter's bf16 dot is broken (it multiplies raw
bit patterns), so the bf16 GEMM runs on CUDA only.
"""

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

from engine.gguf.quants import quantize, random_quantized  # noqa: E402
from engine.kernels.quant import (  # noqa: E402
    QTYPES, QuantExperts, QuantMatrix, qmatmul_experts_reference, qmatmul_reference, resolve_impl,
)

tq = pytest.importorskip("engine.kernels.quant.triton")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GEMV = tq.QuantKernelConfig(gemv_max_m=16)
GEMM = tq.QuantKernelConfig(gemv_max_m=0, block_m=16, block_n=32, block_k=32)
SPLIT = tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=32, gemv_split_k=3)
FP16_AT = {Q.Q4_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
SCALES_AT = {Q.Q4_K: slice(4, 16), Q.Q5_K: slice(4, 16), Q.Q6_K: slice(192, 208)}
K_SMALL = {Q.Q4_0: (96, 256), Q.Q8_0: (96, 256), Q.Q4_K: (256, 512), Q.Q5_K: (256, 512), Q.Q6_K: (256, 512)}


pytestmark = pytest.mark.usefixtures("one_thread")


def from_floats(shape, qtype, rng):
    """``quantize`` of random floats whose scale changes every 16 values."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.exp(rng.uniform(-2, 1, size=(*shape[:-1], shape[-1] // 16, 1))).repeat(16, -1).reshape(shape)
    return quantize(x * 0.05, qtype)


def random_bytes(shape, qtype, rng):
    """Random codes, random fp16 scales of both signs, random packed 6-bit scale bytes."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = random_quantized(shape, qtype, rng, 0.05).reshape(-1, size)
    if qtype in SCALES_AT:
        at = SCALES_AT[qtype]
        blocks[:, at] = rng.integers(0, 256, size=(len(blocks), at.stop - at.start), dtype=np.uint8)
    for off in FP16_AT[qtype]:
        d = (rng.uniform(0.2, 2, len(blocks)) * rng.choice([-1, 1], len(blocks)) * 2e-3).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


MAKERS = {"floats": from_floats, "bytes": random_bytes}


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def make(qtype, n, k, seed, maker="floats", device="cpu"):
    rng = np.random.default_rng(seed)
    return QuantMatrix.from_gguf_bytes(MAKERS[maker]((n, k), qtype, rng), qtype, n, k).to(device)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("maker", MAKERS)
def test_reference_matches_gguf_py(qtype, maker):
    n, k = 7, K_SMALL[qtype][1]
    qm = make(qtype, n, k, seed=1, maker=maker)
    w = torch.from_numpy(gguf.quants.dequantize(qm.raw.numpy(), qtype)).double()  # [n, k]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    assert torch.equal(qm.dequantize(), w.float())
    assert rel_err(qmatmul_reference(x, qm.raw.reshape(-1), qtype, n, k), x.double() @ w.T) < 1e-6


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("M,N", [(1, 7), (3, 45), (17, 130), (33, 45)])
def test_triton_matches_reference_odd_shapes(qtype, M, N):
    """The default dispatch: GEMV for M <= 16, GEMM above."""
    for i, k in enumerate(K_SMALL[qtype]):
        qm = make(qtype, N, k, seed=M * 100 + N + i, maker=list(MAKERS)[(M + i) % 2])
        x = torch.randn(M, k, generator=torch.Generator().manual_seed(M + i))
        out = qm.matmul(x, impl="triton")
        assert out.shape == (M, N) and out.dtype == torch.float32
        assert rel_err(out, qmatmul_reference(x, qm.raw, qtype, N, k)) < 1e-5, (k, tq.QuantKernelConfig())


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("path", ["gemm", "split"])
def test_forced_paths_match_reference(qtype, path):
    """The GEMM at a decode-sized M, and the GEMV with K split into partial sums."""
    M, N, k = (3, 45, K_SMALL[qtype][0]) if path == "gemm" else (5, 19, K_SMALL[qtype][1])
    qm = make(qtype, N, k, seed=7, maker="bytes")
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(3))
    out = tq.qmatmul(x, qm, GEMM if path == "gemm" else SPLIT)
    assert rel_err(out, qmatmul_reference(x, qm.raw, qtype, N, k)) < 1e-5


def test_split_gemv_sums_in_order_and_leaves_its_counters_zeroed():
    """The split that arrives last adds the partial sums in split order: repeated calls (a
    graph replays them) give the same bits, and the arrival counters are zero after each."""
    qm = make(Q.Q4_0, 37, 512, seed=11, maker="bytes")
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4))
    config = tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=64, gemv_split_k=4)
    first = tq.qmatmul(x, qm, config)
    counters = tq._split_counters(x.device)
    assert not counters.any()
    assert torch.equal(tq.qmatmul(x, qm, config), first)
    parts = [tq.qmatmul(x[:, 128 * s:128 * (s + 1)].contiguous(), make_slice(qm, s), config) for s in range(4)]
    assert torch.equal(first, parts[0] + parts[1] + parts[2] + parts[3])
    assert not counters.any()


def make_slice(qm, s):
    """Columns 128 s .. 128 s + 127 of a Q4_0 matrix (four whole blocks of each row)."""
    rb = 4 * 18
    return QuantMatrix(qm.raw[:, s * rb:(s + 1) * rb].contiguous(), Q.Q4_0, qm.n, 128)


@pytest.mark.parametrize("dtype,M", [(torch.float16, 2), (torch.bfloat16, 2), (torch.float16, 20)])
def test_half_inputs_keep_their_dtype(dtype, M):
    qm = make(Q.Q4_K, 45, 256, seed=5)
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M)).to(dtype)
    out = tq.qmatmul(x, qm, GEMV if M <= 16 else GEMM)
    assert out.dtype == dtype
    assert rel_err(out, qmatmul_reference(x.float(), qm.raw, Q.Q4_K, 45, 256)) < (5e-3 if dtype == torch.float16
                                                                                    else 2e-2)


def test_quant_matrix_cpu_path_and_accessors():
    rng = np.random.default_rng(0)
    raw = from_floats((9, 64), Q.Q8_0, rng)
    qm = QuantMatrix.from_gguf_bytes(raw, Q.Q8_0, 9, 64)
    assert qm.nbytes == raw.size == 9 * 2 * 34 and qm.raw.shape == (9, 68)
    assert qm.to("cpu").raw.device.type == "cpu"
    assert qm.dequantize(torch.bfloat16).dtype == torch.bfloat16
    x = torch.randn(4, 64, dtype=torch.float64)
    out = qm.matmul(x)
    assert out.dtype == torch.float64
    assert rel_err(out, x @ qm.dequantize().double().T) < 1e-6
    assert resolve_impl("auto", torch.device("cpu")) == "torch"


def test_bad_inputs_raise_one_clear_error():
    rng = np.random.default_rng(0)
    raw = from_floats((4, 256), Q.Q4_K, rng)
    with pytest.raises(ValueError, match="supports"):
        QuantMatrix.from_gguf_bytes(raw, Q.F16, 4, 256)
    with pytest.raises(ValueError, match="supports"):
        qmatmul_reference(torch.randn(1, 256), raw, Q.Q5_0, 4, 256)
    with pytest.raises(ValueError, match="multiple of the Q4_K block size 256"):
        QuantMatrix.from_gguf_bytes(raw, Q.Q4_K, 8, 128)
    with pytest.raises(ValueError, match="needs 576 bytes, got 575"):
        QuantMatrix.from_gguf_bytes(raw[:-1], Q.Q4_K, 4, 256)
    with pytest.raises(ValueError, match="uint8"):
        QuantMatrix.from_gguf_bytes(torch.zeros(144, dtype=torch.int8), Q.Q4_K, 1, 256)
    qm = QuantMatrix.from_gguf_bytes(raw, Q.Q4_K, 4, 256)
    with pytest.raises(ValueError, match="needs uint8 raw"):
        QuantMatrix(qm.raw.reshape(-1), Q.Q4_K, 4, 256)
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        qm.matmul(torch.randn(2, 255))
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        tq.qmatmul(torch.randn(256), qm)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        tq.qmatmul(torch.ones(2, 256, dtype=torch.float64), qm)
    with pytest.raises(ValueError, match="one of"):
        qm.matmul(torch.randn(1, 256), impl="cuda")
    with pytest.raises(ValueError, match="gemv_block_k"):
        tq.QuantKernelConfig(gemv_block_k=48)
    with pytest.raises(ValueError, match="gemv_max_m"):
        tq.QuantKernelConfig(gemv_max_m=32)


def make_experts(qtype, e, n, k, seed, device="cpu"):
    rng = np.random.default_rng(seed)
    makers = [MAKERS["floats"] if i % 2 else MAKERS["bytes"] for i in range(e)]
    raw = np.concatenate([maker((n, k), qtype, rng) for maker in makers])
    return QuantExperts.from_gguf_bytes(raw, qtype, e, n, k).to(device)


def test_experts_reference_matches_per_pair_loop():
    qe = make_experts(Q.Q6_K, 3, 10, 256, seed=0)
    x = torch.randn(6, 256, dtype=torch.float64)
    ids = torch.tensor([2, 0, -1, 2, 1, 0])
    w = qe.dequantize().double()  # [E, n, k]
    want = torch.stack([w[i] @ x[t] if i >= 0 else torch.zeros(10, dtype=torch.float64)
                        for t, i in enumerate(ids.tolist())])
    assert rel_err(qe.matmul(x, ids), want) < 1e-6
    with pytest.raises(ValueError, match="out of range for 3 experts"):
        qe.matmul(x, torch.tensor([0, 1, 2, 3, 0, 0]))
    with pytest.raises(ValueError, match="ids must be an int tensor"):
        qe.matmul(x, ids.float())
    with pytest.raises(ValueError, match=r"needs uint8 raw|need uint8 raw"):
        QuantExperts(qe.raw[:2], Q.Q6_K, 3, 10, 256)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("T", [1, 5])
def test_experts_triton_matches_reference(qtype, T):
    k = K_SMALL[qtype][0]
    qe = make_experts(qtype, 4, 45, k, seed=T)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, k, generator=g)
    ids = torch.randint(-1, 4, (T,), generator=g)
    ids[0] = 3
    out = qe.matmul(x, ids, impl="triton")
    ref = qmatmul_experts_reference(x, qe.raw, ids, qtype, 45, k)
    assert out.shape == (T, 45) and rel_err(out, ref) < 1e-5
    assert not out[ids < 0].any()


REAL_SHAPES = [(2048, 2048), (512, 2048), (2048, 512), (248320, 2048)]
# the LM head (248,320 rows) ships in Q6_K or Q8_0 only
REAL_CASES = [(q, n, k) for q in QTYPES for n, k in REAL_SHAPES if n != 248320 or q in (Q.Q6_K, Q.Q8_0)]


@pytest.fixture(scope="module")
def real_weights():
    """One cached weight per (qtype, shape) on the GPU."""
    cache = {}

    def get(qtype, n, k):
        if (qtype, n, k) not in cache:
            maker = "floats" if n * k <= 2**24 else "bytes"  # numpy quantizing of the LM head is slow
            cache[(qtype, n, k)] = make(qtype, n, k, seed=n + k, maker=maker, device="cuda")
        return cache[(qtype, n, k)]

    yield get
    cache.clear()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype,n,k", REAL_CASES, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("M", [1, 2, 8, 16, 64, 512])
def test_triton_matches_reference_real_shapes(real_weights, qtype, n, k, M):
    qm = real_weights(qtype, n, k)
    x = torch.randn(M, k, device="cuda", generator=torch.Generator("cuda").manual_seed(M))
    ref = qmatmul_reference(x, qm.raw, qtype, n, k)
    out = qm.matmul(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 2e-2
    assert rel_err(qm.matmul(x), ref) < 1e-4  # fp32 x: tf32-free dots and fp32 GEMV sums


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(512, 2048), (2048, 512)], ids=["gate_up", "down"])
@pytest.mark.parametrize("T", [1, 8, 16])
def test_experts_triton_matches_reference_real_shapes(qtype, n, k, T):
    qe = make_experts(qtype, 16, n, k, seed=T, device="cuda")
    g = torch.Generator("cuda").manual_seed(T)
    x = torch.randn(T, k, device="cuda", generator=g)
    ids = torch.randint(-1, 16, (T,), device="cuda", generator=g)
    ids[0] = 5
    ref = qmatmul_experts_reference(x, qe.raw, ids, qtype, n, k)
    out = qe.matmul(x.bfloat16(), ids)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("T", [1, 3])
def test_fused_quantized_moe_matches_the_per_projection_reference(qtype, T):
    """Gate and up in one launch, down with the weighted sum over each token's pairs in the next:
    the same float32 result as one quantized matmul per projection, with unrouted pairs (-1)
    and tiles that leave a ragged last row block."""
    from engine.hybrid import quantized_moe

    hidden, ffn = (256, 256) if qtype in (Q.Q4_K, Q.Q6_K) else (96, 64)
    E, k = 5, 3
    rng = np.random.default_rng(T)
    stack = [QuantExperts.from_gguf_bytes(random_quantized((E, n, kk), qtype, rng, 0.05), qtype, E, n, kk)
             for n, kk in ((ffn, hidden), (ffn, hidden), (hidden, ffn))]
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, hidden, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[0, 1] = -1
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    ref = quantized_moe(x, stack, ids, w, impl="torch")
    config = tq.QuantKernelConfig(gemv_block_n=16 if qtype in (Q.Q4_K, Q.Q6_K) else 8, gemv_block_k=64
                                  if qtype in (Q.Q4_0, Q.Q8_0) else 256)
    out = tq.quantized_moe_triton(x, *stack, ids, w, config)
    assert out.shape == (T, hidden) and rel_err(out, ref) < 1e-5
    assert rel_err(quantized_moe(x, stack, ids, w, impl="triton"), ref) < 1e-5  # the default tiles
    if hidden != ffn:
        with pytest.raises(ValueError, match="do not make one SwiGLU expert"):
            tq.quantized_moe_triton(x, stack[0], stack[1], stack[0], ids, w)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K], ids=lambda q: q.name)
def test_grouped_quantized_moe_for_long_calls_matches_the_reference(qtype):
    """Past ``gemv_max_m`` tokens the pairs are grouped by expert into tensor-core tiles over
    dequantized weights (blocks padded per expert, unrouted pairs skipped)."""
    from engine.hybrid import quantized_moe

    hidden, ffn = (256, 256) if qtype == Q.Q4_K else (96, 64)
    E, k, T = 5, 2, 21
    rng = np.random.default_rng(5)
    stack = [QuantExperts.from_gguf_bytes(random_quantized((E, n, kk), qtype, rng, 0.05), qtype, E, n, kk)
             for n, kk in ((ffn, hidden), (ffn, hidden), (hidden, ffn))]
    g = torch.Generator().manual_seed(9)
    x = torch.randn(T, hidden, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[3, 0] = -1
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    ref = quantized_moe(x, stack, ids, w, impl="torch")
    config = tq.QuantKernelConfig(block_m=16, block_n=32, block_k=32, gemv_max_m=4)
    out = tq.quantized_moe_triton(x, *stack, ids, w, config)
    assert out.shape == (T, hidden) and rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("M,N,k,block_k", [(17, 45, 128, 64), (40, 19, 96, 32), (21, 33, 96, 64)])
def test_gemm_reads_split_rows_in_whole_blocks(qtype, M, N, k, block_k, monkeypatch):
    """The prefill GEMM over split-layout rows takes whole-block tiles where ``block_k`` divides K (96
    with 64 does not: the per-weight tiles then) and gives the reference's products, odd M and N."""
    qm = make(qtype, N, k, seed=M + N, maker="bytes").with_layout("split")
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(M))
    ref = qmatmul_reference(x, qm.with_layout("ggml").raw, qtype, N, k)
    config = tq.QuantKernelConfig(gemv_max_m=4, block_m=16, block_n=16, block_k=block_k)
    assert tq._halves(qm, block_k) == (k % block_k == 0)
    whole = tq.qmatmul(x, qm, config)
    monkeypatch.setattr(tq, "WHOLE_BLOCK_TILES", False)
    assert rel_err(whole, ref) < 1e-5 and rel_err(tq.qmatmul(x, qm, config), ref) < 1e-5


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("block_k,hidden,ffn", [(32, 96, 64), (64, 128, 192)])
def test_grouped_moe_reads_split_rows_in_whole_blocks(qtype, block_k, hidden, ffn, monkeypatch):
    """The grouped launches over split-layout rows read whole blocks (each tile's low and high halves in
    two products) and give the per-weight path's result, and the reference's; rows past an expert's
    last (45 of 64 in a tile), padded pairs, unrouted pairs and blocks past the last expert's included."""
    from engine.hybrid import quantized_moe

    E, k, T = 5, 3, 23
    rng = np.random.default_rng(11)
    shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    stack = [QuantExperts.from_gguf_bytes(random_quantized((E, n, kk), qtype, rng, 0.05), qtype, E, n, kk)
             for n, kk in shapes]
    split = [qe.with_layout("split") for qe in stack]
    assert all(tq._halves(qe, block_k) for qe in split) and not tq._halves(stack[0], block_k)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(T, hidden, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[4, 1] = -1
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    ref = quantized_moe(x, stack, ids, w, impl="torch")
    config = tq.QuantKernelConfig(block_m=16, block_n=32, block_k=block_k, gemv_max_m=4)
    whole = tq.quantized_moe_triton(x, *split, ids, w, config)
    monkeypatch.setattr(tq, "WHOLE_BLOCK_TILES", False)
    per_weight = tq.quantized_moe_triton(x, *split, ids, w, config)
    assert whole.shape == (T, hidden) and rel_err(whole, ref) < 1e-5
    assert rel_err(whole, per_weight) < 1e-5


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("M,N", [(1, 7), (5, 45), (33, 19)])
def test_split_layout_gives_the_same_products(qtype, M, N):
    """Rows rearranged as codes then scales: the same bytes, the same weights, and the GEMV
    (whole blocks, and a K split), the per-weight GEMV tail and the GEMM read them correctly."""
    from engine.kernels.quant.reference import join_rows, split_rows

    for i, k in enumerate(K_SMALL[qtype]):
        qm = make(qtype, N, k, seed=M + N + i, maker="bytes")
        sp = qm.with_layout("split")
        block_bytes = 18 if qtype == Q.Q4_0 else 34
        assert sp.layout == "split" and sp.raw.shape == qm.raw.shape and sp.split_at == k // 32 * (block_bytes - 2)
        assert torch.equal(join_rows(split_rows(qm.raw, qtype), qtype), qm.raw)
        assert torch.equal(sp.dequantize(), qm.dequantize()) and sp.with_layout("ggml").raw.equal(qm.raw)
        assert not torch.equal(sp.raw, qm.raw)
        x = torch.randn(M, k, generator=torch.Generator().manual_seed(M + i))
        ref = qmatmul_reference(x, qm.raw, qtype, N, k)
        configs = [None, tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=64, gemv_split_k=2),
                   tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=16)]  # 16: the per-weight path
        for config in configs:
            assert rel_err(tq.qmatmul(x, sp, config), ref) < 1e-5, config
        assert rel_err(sp.matmul(x, impl="torch"), ref) < 1e-6


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("layout", ["ggml", "split"])
@pytest.mark.parametrize("k", [4096, 2080])
def test_whole_k_tiles_match_the_reference(qtype, layout, k):
    """K tiles of 2048 and 4096 (the sweep's largest): one tile of the whole of K, two tiles, a tile
    mostly past K (2080 is 65 blocks: 63 masked in a 4096 tile, and in the second 2048 tile), one
    row of x and three, K split in two where it spans two tiles; and the experts' launches with such
    tiles over a hidden of 2080."""
    qm = make(qtype, 5, k, seed=k, maker="bytes").with_layout(layout)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k))
    ref = qmatmul_reference(x, qm.ggml_raw, qtype, 5, k)
    for bk in (2048, 4096):
        for config in (tq.QuantKernelConfig(gemv_block_n=4, gemv_block_k=bk),
                       tq.QuantKernelConfig(gemv_block_n=4, gemv_block_k=bk, gemv_split_k=2)):
            for M in (1, 3):
                assert rel_err(tq.qmatmul(x[:M], qm, config), ref[:M]) < 1e-5, (bk, M, config)
    if k == 2080:
        stack, shared, x, ids, w, ref = _moe_with_shared_case(qtype, layout, 2, 4, 2, k, 64, seed=3)
        for bk in (2048, 4096):
            config = tq.QuantKernelConfig(gemv_block_n=16, gemv_block_k=bk)
            assert rel_err(tq.quantized_moe_triton(x, *stack, ids, w, config, shared=shared), ref) < 1e-5, bk


def test_split_layout_refuses_other_types():
    qm = make(Q.Q4_K, 3, 256, seed=0)
    with pytest.raises(ValueError, match="split layout holds Q4_0, Q8_0, not Q4_K"):
        qm.with_layout("split")
    with pytest.raises(ValueError, match="layout must be one of"):
        QuantMatrix(qm.raw, Q.Q4_K, 3, 256, "tiled")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("n,k,M", [(n, k, M) for n, k in ((2048, 2048), (12352, 2048), (2048, 4096), (1024, 2048))
                                   for M in (1, 4, 64)] + [(248320, 2048, 1)])  # the LM head: one token
def test_cuda_split_layout_real_shapes(real_weights, qtype, n, k, M):
    """The layout the loader gives Q4_0/Q8_0 projections on CUDA, at the 35B shapes: GEMV (a K
    split summed in the kernel among them) and GEMM against the reference; repeated calls give
    the same bits and leave the split counters zeroed."""
    qm = real_weights(qtype, n, k).with_layout("split")
    x = torch.randn(M, k, device="cuda", generator=torch.Generator("cuda").manual_seed(M))
    ref = qmatmul_reference(x, qm.ggml_raw, qtype, n, k)
    out = qm.matmul(x.bfloat16())
    assert rel_err(out, ref) < 2e-2
    exact = qm.matmul(x)
    assert rel_err(exact, ref) < 1e-4
    assert torch.equal(qm.matmul(x), exact)
    assert not tq._split_counters(x.device).any()


def test_word_gemv_refuses_what_it_cannot_read():
    """The word GEMV's checks, which run before its launch (so anywhere): Q4_0 in the split layout only, K a
    multiple of the tile, a block for every lane, powers of two; its config flag is 0 or 1; where it does
    not apply (here: the CPU) ``qmatmul`` keeps the block kernel."""
    words = pytest.importorskip("engine.kernels.quant.words")
    q4 = make(Q.Q4_0, 8, 2048, seed=1, maker="bytes").with_layout("split")
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="Q4_0 in the split layout"):
        words.gemv_words(x, make(Q.Q8_0, 8, 2048, seed=1).with_layout("split"), 4, 2048, 2)
    with pytest.raises(ValueError, match="one block a lane"):
        words.gemv_words(x, q4, 4, 1024, 2)  # 32 blocks for 64 lanes
    with pytest.raises(ValueError, match="power of two"):
        words.gemv_words(x, q4, 3, 2048, 2)
    assert words.fits(q4, 2048, 2) and words.fits(q4, 1024, 1)
    assert not words.fits(q4, 4096, 1) and not words.fits(q4.with_layout("ggml"), 2048, 2)
    with pytest.raises(ValueError, match="gemv_words"):
        tq.QuantKernelConfig(gemv_words=2)
    config = tq.QuantKernelConfig(gemv_words=1, gemv_block_n=4, gemv_block_k=2048, gemv_num_warps=2)
    ref = qmatmul_reference(x, q4.with_layout("ggml").raw, Q.Q4_0, 8, 2048)
    assert rel_err(tq.qmatmul(x, q4, config), ref) < 1e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k,block_n,block_k,warps", [
    (12352, 2048, 4, 2048, 2), (9216, 2048, 8, 2048, 2), (2048, 4096, 4, 4096, 4), (2048, 4096, 8, 2048, 1),
    (248320, 2048, 8, 1024, 1), (37, 2048, 4, 1024, 1), (5, 1024, 2, 1024, 1), (1024, 2048, 1, 2048, 2)])
def test_cuda_word_gemv(real_weights, n, k, block_n, block_k, warps):
    """The word GEMV (``engine.kernels.quant.words``) at the 35B projection shapes and odd row counts, K in
    one tile or several, through ``qmatmul``'s ``gemv_words`` tiles: the reference's products for float32
    and bf16 x, the same bits on every call and as the kernel called directly."""
    from engine.kernels.quant import words

    qm = real_weights(Q.Q4_0, n, k).with_layout("split")
    x = torch.randn(1, k, device="cuda", generator=torch.Generator("cuda").manual_seed(n))
    ref = qmatmul_reference(x, qm.ggml_raw, Q.Q4_0, n, k)
    config = tq.QuantKernelConfig(gemv_words=1, gemv_block_n=block_n, gemv_block_k=block_k, gemv_num_warps=warps)
    exact = tq.qmatmul(x, qm, config)
    assert exact.shape == (1, n) and rel_err(exact, ref) < 1e-4
    assert rel_err(tq.qmatmul(x.bfloat16(), qm, config), ref) < 2e-2
    assert torch.equal(tq.qmatmul(x, qm, config), exact)
    assert torch.equal(words.gemv_words(x, qm, block_n, block_k, warps), exact)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype,layout", [(Q.Q4_0, "ggml"), (Q.Q4_0, "split"), (Q.Q4_K, "ggml")],
                         ids=["Q4_0", "Q4_0-split", "Q4_K"])  # the split layout holds Q4_0 and Q8_0 only
@pytest.mark.parametrize("T", [1, 8, 16, 64, 300])
def test_cuda_quantized_moe_real_shapes(qtype, layout, T):
    """The fused decode launches (T <= 16) and the grouped tiles (longer calls) at the 35B
    expert shapes, 8 of 16 experts per token, against one quantized matmul per projection."""
    from engine.hybrid import quantized_moe

    stack = [make_experts(qtype, 16, n, k, seed=i, device="cuda").with_layout(layout)
             for i, (n, k) in enumerate(((512, 2048), (512, 2048), (2048, 512)))]
    g = torch.Generator("cuda").manual_seed(T)
    x = torch.randn(T, 2048, device="cuda", generator=g)
    ids = torch.stack([torch.randperm(16, device="cuda", generator=g)[:8] for _ in range(T)])
    ids[0, 3] = -1
    w = torch.softmax(torch.randn(T, 8, device="cuda", generator=g), -1)
    ref = quantized_moe(x, stack, ids, w, impl="torch")
    assert rel_err(quantized_moe(x.bfloat16(), stack, ids, w, impl="triton"), ref) < 2e-2
    assert rel_err(quantized_moe(x, stack, ids, w, impl="triton"), ref) < 1e-4


def _moe_with_shared_case(qtype, layout, T, E, k, hidden, ffn, seed, device="cpu", logits=None):
    """Routed experts, a shared expert of one routed expert's shape (gate and up merged), the
    routing and the float32 reference ``routed + sigmoid(x . gate_inp) * shared``; with ``logits``
    [T], gate_inp is the one of least norm that gives token t the gate logit ``logits[t]``."""
    from engine.hybrid import quantized_moe

    rng = np.random.default_rng(seed)
    stack = [QuantExperts.from_gguf_bytes(random_quantized((E, n, kk), qtype, rng, 0.05), qtype, E, n, kk)
             .to(device).with_layout(layout) for n, kk in ((ffn, hidden), (ffn, hidden), (hidden, ffn))]
    s_gu = QuantMatrix.from_gguf_bytes(random_quantized((2 * ffn, hidden), qtype, rng, 0.05), qtype, 2 * ffn,
                                       hidden).to(device).with_layout(layout)
    s_down = QuantMatrix.from_gguf_bytes(random_quantized((hidden, ffn), qtype, rng, 0.05), qtype, hidden,
                                         ffn).to(device).with_layout(layout)
    g = torch.Generator().manual_seed(seed)
    gate_inp = (torch.randn(hidden, generator=g) * 0.1).to(device)
    x = torch.randn(T, hidden, generator=g).to(device)
    if logits is not None:
        gate_inp = x.T @ torch.linalg.solve(x @ x.T, logits.to(device))
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
    ids[0, 1] = -1
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(device)
    routed = quantized_moe(x, stack, ids, w, impl="torch").float()
    gu = qmatmul_reference(x, s_gu.ggml_raw, qtype, 2 * ffn, hidden)
    act = torch.nn.functional.silu(gu[:, :ffn]) * gu[:, ffn:]
    shared = qmatmul_reference(act, s_down.ggml_raw, qtype, hidden, ffn)
    ref = routed + torch.sigmoid(x.float() @ gate_inp)[:, None] * shared
    return stack, (s_gu, s_down, gate_inp), x, ids, w, ref


@pytest.mark.parametrize("qtype,layout", [(Q.Q4_0, "ggml"), (Q.Q4_0, "split"), (Q.Q8_0, "split"), (Q.Q4_K, "ggml")],
                         ids=["Q4_0", "Q4_0-split", "Q8_0-split", "Q4_K"])
@pytest.mark.parametrize("T", [1, 3])
def test_shared_expert_rides_in_the_routed_launches(qtype, layout, T):
    """The shared expert as one more pair of the two decode launches: the routed sum plus the
    gated shared output, as the separate computation gives it; a mismatched shared expert and a
    long call are refused."""
    hidden, ffn = (256, 256) if qtype == Q.Q4_K else (96, 64)
    stack, shared, x, ids, w, ref = _moe_with_shared_case(qtype, layout, T, 5, 3, hidden, ffn, seed=T)
    config = tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=64 if qtype != Q.Q4_K else 256)
    out = tq.quantized_moe_triton(x, *stack, ids, w, config, shared=shared)
    assert out.shape == (T, hidden) and rel_err(out, ref) < 1e-5
    assert tq.shared_fits(stack[0], stack[2], *shared[:2])
    s_gu, s_down, gate_inp = shared
    assert not tq.shared_fits(stack[0], stack[2], s_down, s_gu)
    with pytest.raises(ValueError, match="does not match the routed experts"):
        tq.quantized_moe_triton(x, *stack, ids, w, config, shared=(s_gu, s_down, gate_inp[:-1]))
    with pytest.raises(ValueError, match="decode launches only"):
        tq.quantized_moe_triton(x, *stack, ids, w, tq.QuantKernelConfig(gemv_max_m=0), shared=shared)


@pytest.mark.parametrize("layout", ["ggml", "split"])
def test_shared_gate_is_computed_once_per_token_for_its_own_token(layout):
    """The gate/up launch stores each token's ``sigmoid(x . gate_inp)`` once and the down launch reads
    it: three tokens with gates far from 0.5 and from each other (0.98, 0.0025, 0.82), so that another
    token's gate (or a gate of 0.5) would show, through the block kernels and, in the split layout, the
    row kernels and both mixes of the two launches (the gate stored by one kind, read by the other)."""
    logits = torch.tensor([4.0, -6.0, 1.5])
    stack, shared, x, ids, w, ref = _moe_with_shared_case(Q.Q4_0, layout, 3, 5, 3, 96, 64, seed=11, logits=logits)
    assert torch.allclose(x @ shared[2], logits, atol=1e-4)
    *_, swapped = _moe_with_shared_case(Q.Q4_0, layout, 3, 5, 3, 96, 64, seed=11, logits=logits.roll(1))
    assert all(rel_err(swapped[t], ref[t]) > 1e-2 for t in range(3))  # the gates matter at this tolerance
    blocks = tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=64)
    launches = [(blocks, blocks), (blocks, tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=64, gemv_pair_split=1))]
    if layout == "split":
        up, down = tq.QuantKernelConfig(gemv_rows_warps=2), tq.QuantKernelConfig(gemv_rows_warps=4)
        launches += [(up, down), (up, blocks), (blocks, down)]
    for up, down in launches:
        out = tq.quantized_moe_triton(x, *stack, ids, w, up, down, shared=shared)
        for t in range(3):
            assert rel_err(out[t], ref[t]) < 1e-5, (t, up, down)


@pytest.mark.parametrize("qtype,layout,with_shared", [(Q.Q4_0, "split", True), (Q.Q4_0, "ggml", False),
                                                     (Q.Q8_0, "split", False), (Q.Q4_K, "ggml", True)],
                         ids=["Q4_0-split-shared", "Q4_0", "Q8_0-split", "Q4_K-shared"])
def test_down_split_per_pair_adds_in_pair_order(qtype, layout, with_shared):
    """The down launch with a program per pair: the per-token program's output bit for bit (the same
    sum in the same order), an unrouted pair (-1) adding nothing, a ragged last row block, three
    tokens, and a call after another (each leaves its counters zeroed for the next)."""
    from engine.hybrid import quantized_moe

    hidden, ffn = (256, 256) if qtype == Q.Q4_K else (96, 64)
    bk = 256 if qtype == Q.Q4_K else 64
    T = 3
    stack, shared, x, ids, w, ref = _moe_with_shared_case(qtype, layout, T, 5, 3, hidden, ffn, seed=T)
    if not with_shared:
        shared = None
        ref = quantized_moe(x, stack, ids, w, impl="torch")
    up = tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=bk)
    # 96 rows: 64 leaves a ragged last block (Q4_K's 256 rows: whole blocks of 64)
    for bn in (8, 64) if qtype != Q.Q4_K else (64,):
        per_token = tq.QuantKernelConfig(gemv_block_n=bn, gemv_block_k=bk)
        per_pair = tq.QuantKernelConfig(gemv_block_n=bn, gemv_block_k=bk, gemv_pair_split=1)
        a = tq.quantized_moe_triton(x, *stack, ids, w, up, per_token, shared=shared)
        b = tq.quantized_moe_triton(x, *stack, ids, w, up, per_pair, shared=shared)
        assert torch.equal(a, b), bn
        assert rel_err(b, ref) < 1e-5
    assert torch.equal(tq.quantized_moe_triton(x, *stack, ids, w, up, per_pair, shared=shared), b)  # counters zeroed
    with pytest.raises(ValueError, match="gemv_pair_split"):
        tq.QuantKernelConfig(gemv_pair_split=2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 16])
def test_cuda_shared_expert_rides_in_the_routed_launches_real_shapes(T):
    """The 35B expert shapes (hidden 2048, ffn 512, 8 of 16 experts), Q4_0 in the split layout."""
    stack, shared, x, ids, w, ref = _moe_with_shared_case(Q.Q4_0, "split", T, 16, 8, 2048, 512, seed=T,
                                                          device="cuda")
    assert rel_err(tq.quantized_moe_triton(x, *stack, ids, w, shared=shared), ref) < 1e-4
    assert rel_err(tq.quantized_moe_triton(x.bfloat16(), *stack, ids, w, shared=shared), ref) < 2e-2
    for bn in (4, 16):  # the down launch with a program per pair, compiled: the per-token sum bit for bit
        per_token = tq.QuantKernelConfig(gemv_block_n=bn, gemv_block_k=512)
        per_pair = tq.QuantKernelConfig(gemv_block_n=bn, gemv_block_k=512, gemv_pair_split=1)
        up = tq.QuantKernelConfig(gemv_block_n=4, gemv_block_k=512)
        a = tq.quantized_moe_triton(x, *stack, ids, w, up, per_token, shared=shared)
        b = tq.quantized_moe_triton(x, *stack, ids, w, up, per_pair, shared=shared)
        assert torch.equal(a, b) and rel_err(b, ref) < 1e-4


def _staged_case(qtype, layout, T, E, k, hidden, ffn, seed, device="cpu"):
    """Experts in two stacks (``E`` slots and a stage of ``T * k`` rows holding other experts): ids mixing
    slots (>= 0), stage rows (``-2 - j``) and unrouted pairs (-1), with the reference from one stack holding
    both, where the same pairs read the same experts."""
    stack, shared, x, ids, w, _ = _moe_with_shared_case(qtype, layout, T, E, k, hidden, ffn, seed, device=device)
    rng = np.random.default_rng(seed + 100)
    P = T * k
    extra = [QuantExperts.from_gguf_bytes(random_quantized((P, r, c), qtype, rng, 0.05), qtype, P, r, c)
             .to(device).with_layout(layout) for r, c in ((ffn, hidden), (ffn, hidden), (hidden, ffn))]
    g = torch.Generator().manual_seed(seed)
    staged = torch.rand(T, k, generator=g) < 0.5
    staged[0, 0], staged[0, 1] = True, False  # at least one staged pair; ids[0, 1] is -1 (unrouted)
    rows = torch.arange(P).view(T, k)
    codes = torch.where(staged.to(device), -2 - rows.to(device), ids)
    both = tuple(QuantExperts(torch.cat([a.raw, b.raw]), a.qtype, a.e + b.e, a.n, a.k, a.layout)
                 for a, b in zip(stack, extra))
    ref_ids = torch.where(staged.to(device), E + rows.to(device), ids)
    return stack, tuple(extra), both, shared, x, codes, ref_ids, w


# every type with a shared expert; without one only Q4_0 (the stage's read is the same code either way)
@pytest.mark.parametrize("qtype,layout,with_shared", [
    (Q.Q4_0, "split", True), (Q.Q4_0, "split", False), (Q.Q8_0, "ggml", True), (Q.Q4_K, "ggml", True)],
    ids=["shared-Q4_0-split", "routed-Q4_0-split", "shared-Q8_0", "shared-Q4_K"])
def test_stage_stack_is_read_for_its_ids(qtype, layout, with_shared):
    """Ids ``-2 - j`` read expert ``j`` of the stage stacks: the same output as one stack holding both sets,
    through both down launches (per token and per pair) and the block and row gate/up launches; a float32
    output on request; a stage of another layout is refused."""
    hidden, ffn = (256, 256) if qtype == Q.Q4_K else (96, 64)
    bk = 256 if qtype == Q.Q4_K else 64
    stack, stage, both, shared, x, codes, ref_ids, w = _staged_case(qtype, layout, 3, 5, 3, hidden, ffn, seed=21)
    shared = shared if with_shared else None
    up = tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=bk)
    ref = tq.quantized_moe_triton(x, *both, ref_ids, w, up, shared=shared)
    for b in (up, tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=bk, gemv_pair_split=1)):
        assert torch.equal(tq.quantized_moe_triton(x, *stack, codes, w, up, b, shared=shared, stage=stage), ref), b
    if layout == "split":  # the row kernels take no stage: the block kernels run instead (other tiles)
        rows_up, rows_down = tq.QuantKernelConfig(gemv_rows_warps=2), tq.QuantKernelConfig(gemv_rows_warps=4)
        out = tq.quantized_moe_triton(x, *stack, codes, w, rows_up, rows_down, shared=shared, stage=stage)
        assert rel_err(out, ref) < 1e-5
    f32 = tq.quantized_moe_triton(x.bfloat16(), *stack, codes, w, up, shared=shared, stage=stage,
                                  out_dtype=torch.float32)
    assert f32.dtype == torch.float32 and rel_err(f32, ref) < 2e-2
    if layout == "split":
        with pytest.raises(ValueError, match="stage stacks must have"):
            tq.quantized_moe_triton(x, *stack, codes, w, up, stage=tuple(s.with_layout("ggml") for s in stage))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4])
def test_cuda_stage_stack_real_shapes(T):
    """The 35B expert shapes, Q4_0 in the split layout (the word gate/up launch, the per-pair down launch):
    a stage stack read for ids ``-2 - j`` gives the output of one stack holding both, bit for bit."""
    stack, stage, both, shared, x, codes, ref_ids, w = _staged_case(Q.Q4_0, "split", T, 16, 8, 2048, 512, seed=T,
                                                                    device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        ref = tq.quantized_moe_triton(x.to(dtype), *both, ref_ids, w, shared=shared)
        out = tq.quantized_moe_triton(x.to(dtype), *stack, codes, w, shared=shared, stage=stage)
        assert torch.equal(out, ref), dtype


def test_word_gate_up_refuses_what_it_cannot_read():
    """The experts' word gate/up launch checks before it launches (so anywhere): Q4_0 experts in the split
    layout, a block for every lane, powers of two, a shared expert read as the routed ones are; where it
    does not apply (here: the CPU) ``quantized_moe_triton`` keeps the block kernel."""
    words = pytest.importorskip("engine.kernels.quant.words")
    stack, shared, x, ids, w, ref = _moe_with_shared_case(Q.Q4_0, "split", 2, 5, 3, 1024, 64, seed=4)
    gate, up = stack[0], stack[1]
    act = torch.empty(8, 64)
    assert words.experts_fit(gate, up, 1024, 1) and not words.experts_fit(gate, up, 1024, 2)
    assert not words.experts_fit(gate.with_layout("ggml"), up.with_layout("ggml"), 1024, 1)
    with pytest.raises(ValueError, match="one block a lane"):
        words.moe_gate_up_words(x, gate, up, ids, act, 6, 3, None, 4, 1024, 2)
    with pytest.raises(ValueError, match="power of two"):
        words.moe_gate_up_words(x, gate, up, ids, act, 6, 3, None, 3, 1024, 1)
    q8 = _moe_with_shared_case(Q.Q8_0, "split", 2, 5, 3, 1024, 64, seed=4)[0]
    assert not words.experts_fit(q8[0], q8[1], 1024, 1)
    s_gu = shared[0].with_layout("ggml")
    with pytest.raises(ValueError, match="shared expert"):
        words.moe_gate_up_words(x, gate, up, ids, act, 6, 3, (s_gu, shared[2], torch.empty(2)), 4, 1024, 1)
    config = tq.QuantKernelConfig(gemv_words=1, gemv_block_n=4, gemv_block_k=1024, gemv_num_warps=1)
    assert rel_err(tq.quantized_moe_triton(x, *stack, ids, w, config, shared=shared), ref) < 1e-5


def test_word_down_refuses_what_it_cannot_read():
    """The experts' word down launch checks before it launches: Q4_0 in the split layout, K (ffn) a power of
    two of 2 to 32 blocks, rows a whole number of lane groups, powers of two; on the CPU
    ``quantized_moe_triton`` keeps the block kernel."""
    words = pytest.importorskip("engine.kernels.quant.words")
    stack, shared, x, ids, w, ref = _moe_with_shared_case(Q.Q4_0, "split", 2, 5, 3, 96, 512, seed=6)
    down = stack[2]  # [5, 96, 512]: 16 blocks, lane groups of 16, 2 a warp
    assert down.k == 512 and words.down_fits(down, 2, 1) and words.down_fits(down, 8, 4)
    assert not words.down_fits(down, 4, 4) and not words.down_fits(down.with_layout("ggml"), 2, 1)
    act, out = torch.empty(8, 512), torch.empty(2, 96)
    with pytest.raises(ValueError, match="whole number of lane groups"):
        words.moe_down_words(act, down, ids, w, out, 6, 3, None, 2, 2)
    with pytest.raises(ValueError, match="powers of two"):
        words.moe_down_words(act, down, ids, w, out, 6, 3, None, 6, 1)
    short = _moe_with_shared_case(Q.Q4_0, "split", 2, 5, 3, 96, 96, seed=6)[0][2]  # 3 blocks
    assert not words.down_fits(short, 2, 1)
    config = tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=512)
    down_cfg = tq.QuantKernelConfig(gemv_words=1, gemv_block_n=2, gemv_num_warps=1)
    assert rel_err(tq.quantized_moe_triton(x, *stack, ids, w, config, down_cfg, shared=shared), ref) < 1e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("launch,tiles", [
    ("gate_up", dict(gemv_block_n=8, gemv_block_k=2048, gemv_num_warps=2)),
    ("gate_up", dict(gemv_block_n=4, gemv_block_k=1024, gemv_num_warps=1)),
    ("gate_up", dict(gemv_block_n=16, gemv_block_k=2048, gemv_num_warps=2)),
    ("down", dict(gemv_block_n=2, gemv_num_warps=1)), ("down", dict(gemv_block_n=8, gemv_num_warps=2)),
    ("down", dict(gemv_block_n=16, gemv_num_warps=4))])
def test_cuda_word_expert_launches_real_shapes(T, launch, tiles, monkeypatch):
    """The experts' gate/up or down launch in the word layout (``engine.kernels.quant.words``) at the 35B
    expert shapes (hidden 2048, ffn 512, 8 of 16 experts, a pair routed nowhere, the shared expert riding
    along), Q4_0 in the split layout, the other launch the block kernel's: the reference's result for
    float32 and bf16 x, the block kernels' within float32 rounding, with and without the shared expert,
    the same bits on every call, and the word launch really taken."""
    from engine.kernels.quant import words

    stack, shared, x, ids, w, ref = _moe_with_shared_case(Q.Q4_0, "split", T, 16, 8, 2048, 512, seed=T,
                                                          device="cuda")
    plain_up = tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=512)
    plain_down = tq.QuantKernelConfig(gemv_block_n=16, gemv_block_k=512, gemv_split_k=1, gemv_pair_split=1)
    word = tq.QuantKernelConfig(gemv_words=1, **tiles)
    up, down = (word, plain_down) if launch == "gate_up" else (plain_up, word)
    name = "moe_gate_up_words" if launch == "gate_up" else "moe_down_words"
    calls = []
    real = getattr(words, name)
    monkeypatch.setattr(words, name, lambda *a: calls.append(1) or real(*a))
    out = tq.quantized_moe_triton(x, *stack, ids, w, up, down, shared=shared)
    assert calls == [1] and rel_err(out, ref) < 1e-4
    assert torch.equal(tq.quantized_moe_triton(x, *stack, ids, w, up, down, shared=shared), out)
    assert rel_err(out, tq.quantized_moe_triton(x, *stack, ids, w, plain_up, plain_down, shared=shared)) < 1e-5
    assert rel_err(tq.quantized_moe_triton(x.bfloat16(), *stack, ids, w, up, down, shared=shared), ref) < 2e-2
    assert rel_err(tq.quantized_moe_triton(x, *stack, ids, w, up, down),
                   tq.quantized_moe_triton(x, *stack, ids, w, plain_up, plain_down)) < 1e-5


@pytest.mark.parametrize("layout", ["ggml", "split"])
def test_long_half_precision_calls_dequantize_once_then_multiply_densely(layout, monkeypatch):
    """From ``dequant_min_m`` rows of a bf16 x the weight is dequantized once and multiplied by
    the dense matmul (the GEMM kernel is not launched); float32 x keeps the exact GEMM."""
    qm = make(Q.Q4_0, 45, 96, seed=3).with_layout(layout)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(2))
    ref = qmatmul_reference(x, qm.ggml_raw, Q.Q4_0, 45, 96)
    config = tq.QuantKernelConfig(dequant_min_m=20)
    launched = []
    real = tq.qmatmul_gemm
    monkeypatch.setattr(tq, "qmatmul_gemm", lambda *a, **k: launched.append(1) or real(*a, **k))
    out = tq.qmatmul(x.bfloat16(), qm, config)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 2e-2 and not launched
    assert rel_err(tq.qmatmul(x, qm, config), ref) < 1e-5 and launched == [1]
    tq.qmatmul(x[:19].bfloat16(), qm, config)
    assert launched == [1, 1]
    with pytest.raises(ValueError, match="dequant_min_m"):
        tq.QuantKernelConfig(dequant_min_m=-1)


def test_split_layout_is_for_cuda_and_can_be_switched_off(monkeypatch):
    from engine.kernels.quant.reference import split_layout_on

    assert not split_layout_on("cpu")
    monkeypatch.delenv("LUCE_TUNE_SPLIT_LAYOUT", raising=False)
    assert split_layout_on("cuda")
    monkeypatch.setenv("LUCE_TUNE_SPLIT_LAYOUT", "0")
    assert not split_layout_on("cuda")


ROWS = [tq.QuantKernelConfig(gemv_rows_warps=w, gemv_rows_unroll=u, gemv_split_k=s)
        for w, u, s in ((1, 1, 1), (2, 4, 0), (4, 2, 3), (8, 8, 1))]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("N", [1, 33, 70])
def test_row_kernel_gemv_matches_the_reference(qtype, N):
    """One weight row per lane (``engine.kernels.quant.rows``): odd row counts (a partial last
    program), K of 3 and 9 blocks shared out unevenly among warps, unroll runs longer than a warp's
    blocks, K splits added in order; the codes' exponent-trick conversion gives every code exactly."""
    for i, k in enumerate((96, 288)):
        qm = make(qtype, N, k, seed=N + i, maker="bytes").with_layout("split")
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(N + i))
        ref = qmatmul_reference(x, qm.ggml_raw, qtype, N, k)
        for config in ROWS:
            out = tq.qmatmul(x, qm, config)
            assert out.shape == (1, N) and rel_err(out, ref) < 1e-5, config
        assert not tq._split_counters(x.device).any()
        half = tq.qmatmul(x.bfloat16(), qm, ROWS[1])
        assert half.dtype == torch.bfloat16 and rel_err(half, ref) < 2e-2


def test_row_kernel_codes_cover_every_byte():
    """Every Q4_0 byte (both nibbles) and every Q8_0 code, in blocks of scale 1: the row kernel's dot with
    one-hot x gives the code itself. Each weight row holds every code, its blocks rotated by the row's index,
    so every block of codes passes through the first and the last block position: x one-hot in those two
    blocks reads every code, in each place of a block, in both."""
    from engine.kernels.quant.reference import split_rows

    for qtype, per_block in ((Q.Q4_0, 16), (Q.Q8_0, 32)):
        size = GGML_QUANT_SIZES[qtype][1]
        codes = np.arange(256, dtype=np.uint8)
        n_blocks = 256 // per_block
        blocks = np.zeros((n_blocks, size), dtype=np.uint8)
        blocks[:, :2] = np.frombuffer(np.float16(1).tobytes(), dtype=np.uint8)
        blocks[:, 2:] = codes.reshape(n_blocks, per_block)
        rows = np.stack([np.roll(blocks, r, axis=0).reshape(-1) for r in range(n_blocks)])
        k = 32 * n_blocks
        qm = QuantMatrix(split_rows(torch.from_numpy(rows), qtype), qtype, n_blocks, k, "split")
        want = qm.dequantize()
        for j in [*range(32), *range(k - 32, k)]:
            x = torch.zeros(1, k)
            x[0, j] = 1.0
            got = tq.qmatmul(x, qm, ROWS[0])[0]
            assert torch.equal(got, want[:, j]), (qtype.name, j, got, want[:, j])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("T", [1, 3])
def test_row_kernels_for_the_experts_match_the_reference(qtype, T):
    """The routed experts' two launches with one row per lane (gate and up halves of the warps;
    one pair per warp in down, the shared expert's blocks shared out after): against the separate
    computation, with a dead pair (-1), a top-k of 3 (warps past it idle) and a shared expert."""
    stack, shared, x, ids, w, ref = _moe_with_shared_case(qtype, "split", T, 5, 3, 96, 64, seed=T)
    for wu, wd, u in ((2, 4, 1), (4, 4, 2), (8, 8, 4)):
        up = tq.QuantKernelConfig(gemv_rows_warps=wu, gemv_rows_unroll=u)
        down = tq.QuantKernelConfig(gemv_rows_warps=wd, gemv_rows_unroll=u)
        out = tq.quantized_moe_triton(x, *stack, ids, w, up, down, shared=shared)
        assert rel_err(out, ref) < 1e-5, (wu, wd, u)
        routed_only = tq.quantized_moe_triton(x, *stack, ids, w, up, down)
        assert rel_err(routed_only, tq.quantized_moe_triton(x, *stack, ids, w)) < 1e-5


def test_row_kernel_settings_are_checked():
    with pytest.raises(ValueError, match="gemv_rows_warps must be a power of two"):
        tq.QuantKernelConfig(gemv_rows_warps=3)
    for bad in (0, 16):
        with pytest.raises(ValueError, match="gemv_rows_unroll must be a power of two up to 8"):
            tq.QuantKernelConfig(gemv_rows_unroll=bad)
    from engine.kernels.quant import rows

    qm = make(Q.Q4_K, 3, 256, seed=0)
    with pytest.raises(ValueError, match="Q4_0/Q8_0 in the split layout"):
        rows.gemv_rows(torch.randn(1, 256), qm, None, None)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(12352, 2048), (2048, 4096), (2048, 512), (248320, 2048)])
def test_cuda_row_kernel_gemv_real_shapes(real_weights, qtype, n, k):
    """The row kernel at the 35B projection shapes and the LM head, every grid setting's corner:
    float32 to the reference, bf16 within its rounding, the same bits on a repeat, counters zeroed."""
    qm = real_weights(qtype, n, k).with_layout("split")
    x = torch.randn(1, k, device="cuda", generator=torch.Generator("cuda").manual_seed(n + k))
    ref = qmatmul_reference(x, qm.ggml_raw, qtype, n, k)
    for w, u, s in ((1, 2, 0), (4, 4, 0), (8, 8, 1), (2, 8, 2)):
        config = tq.QuantKernelConfig(gemv_rows_warps=w, gemv_rows_unroll=u, gemv_split_k=s)
        exact = tq.qmatmul(x, qm, config)
        assert rel_err(exact, ref) < 1e-4, (w, u, s)
        assert torch.equal(tq.qmatmul(x, qm, config), exact)
        assert rel_err(tq.qmatmul(x.bfloat16(), qm, config), ref) < 2e-2
    assert not tq._split_counters(x.device).any()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 16])
def test_cuda_row_kernels_for_the_experts_real_shapes(T):
    """The routed experts with the shared expert riding along, 35B shapes, Q4_0 split, row kernels."""
    stack, shared, x, ids, w, ref = _moe_with_shared_case(Q.Q4_0, "split", T, 16, 8, 2048, 512, seed=T,
                                                          device="cuda")
    for wu, wd, u in ((2, 8, 2), (8, 8, 4), (4, 16, 8)):
        up = tq.QuantKernelConfig(gemv_rows_warps=wu, gemv_rows_unroll=u)
        down = tq.QuantKernelConfig(gemv_rows_warps=wd, gemv_rows_unroll=u)
        assert rel_err(tq.quantized_moe_triton(x, *stack, ids, w, up, down, shared=shared), ref) < 1e-4
        assert rel_err(tq.quantized_moe_triton(x.bfloat16(), *stack, ids, w, up, down, shared=shared), ref) < 2e-2
