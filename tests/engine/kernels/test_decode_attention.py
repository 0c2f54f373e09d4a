"""The split-key decode attention kernel (engine.kernels.decode_attention) against the grouped
SDPA it replaces in the captured step (``engine.model.attention.grouped_attention``).

Bounds: float32 within 1e-5 of the largest output (the same maths, the softmax summed per chunk
then combined); bf16 on CUDA within 2e-2 (probabilities rounded to bf16 before the value product,
as flash attention does).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are decorated

pytest.importorskip("triton")

from engine.kernels import decode_attention as da  # noqa: E402
from engine.model.attention import grouped_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def case(T, n_head, n_kv, D, L, past, seed, dtype=torch.float32, holes=False, device=DEVICE):
    """q for T tokens written at slots past .. past+T-1 of an L-slot cache; the slots past them hold
    large values no query may see; ``holes``: some earlier keys hidden too (a rolled-back draft)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, n_head, D, generator=g)
    keys = torch.randn(n_kv, L, D, generator=g)
    values = torch.randn(n_kv, L, D, generator=g)
    keys[:, past + T:] = 1e3
    values[:, past + T:] = -1e3
    slots = torch.arange(past, past + T)
    idx = torch.arange(L)
    visible = idx[None, :] <= slots[:, None]
    if holes:
        visible[:, 1:past:3] = False
    return (q.to(device, dtype), keys.to(device, dtype), values.to(device, dtype), visible.to(device),
            slots.to(device))


@pytest.mark.parametrize("T,n_head,n_kv,D,L,past", [
    (1, 4, 2, 32, 600, 530),  # three chunks, the last ragged; the step's token in the third
    (3, 6, 3, 16, 300, 7),  # one chunk with keys written, one skipped
    (2, 4, 1, 64, 257, 255),  # the tokens straddle a chunk boundary
])
@pytest.mark.parametrize("holes", [False, True])
def test_matches_grouped_attention(T, n_head, n_kv, D, L, past, holes):
    q, keys, values, visible, slots = case(T, n_head, n_kv, D, L, past, seed=T + L, holes=holes)
    out = da.decode_attention_triton(q, keys, values, visible, slots, chunk=256)  # the layouts described above
    ref = grouped_attention(q, keys, values, visible)
    assert rel_err(da.decode_attention_triton(q, keys, values, visible, slots), ref) < 1e-5  # chunk_for(L)
    assert out.shape == (T, n_head * D) and out.dtype == q.dtype
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("chunk", [32, 64, 512])
def test_other_chunk_sizes_give_the_same_attention(chunk):
    """Keys per program from one step (32) to more than the cache holds (512): the same output."""
    q, keys, values, visible, slots = case(2, 4, 2, 32, 300, 150, seed=5, holes=True)
    out = da.decode_attention_triton(q, keys, values, visible, slots, chunk=chunk)
    assert rel_err(out, grouped_attention(q, keys, values, visible)) < 1e-5
    with pytest.raises(ValueError, match="power of two of at least 32"):
        da.decode_attention_triton(q, keys, values, visible, slots, chunk=48)


def test_chunk_follows_the_cache_length(monkeypatch):
    """64 keys per program up to 4,096 cache slots, 128 up to 8,192, 256 beyond; a module-level
    ``CHUNK`` (a benchmark's) overrides the rule."""
    assert [da.chunk_for(n) for n in (1, 600, 4096, 4097, 8192, 8193, 262144)] == [64, 64, 64, 128, 128, 256, 256]
    q, keys, values, visible, slots = case(2, 4, 2, 32, 300, 150, seed=6)
    seen = []
    real = da._chunk_kernel

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid[1])  # programs along the keys: the cache's chunks
            return real[grid]

    monkeypatch.setattr(da, "_chunk_kernel", Spy())
    da.decode_attention_triton(q, keys, values, visible, slots)
    monkeypatch.setattr(da, "CHUNK", 256)
    da.decode_attention_triton(q, keys, values, visible, slots)
    assert seen == [5, 2]  # 300 slots: 5 chunks of 64, then 2 of 256


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's limit")
def test_the_interpreter_takes_float32_caches_only():
    """Under the Triton interpreter a bf16 cache is not taken (its tl.dot of bf16 operands returns
    garbage): ``supports`` says no, so the step keeps torch's attention, and a forced call says why."""
    q, keys, values, visible, slots = case(2, 4, 2, 32, 64, 10, seed=2, dtype=torch.bfloat16)
    assert not da.supports(q, keys)
    with pytest.raises(ValueError, match="interpreter cannot run the decode attention on torch.bfloat16"):
        da.decode_attention_triton(q, keys, values, visible, slots)


def test_more_query_rows_than_one_block():
    """16 tokens of 4 query heads per KV head: 64 rows, four row blocks."""
    q, keys, values, visible, slots = case(16, 8, 2, 16, 280, 200, seed=3)
    assert rel_err(da.decode_attention_triton(q, keys, values, visible, slots),
                   grouped_attention(q, keys, values, visible)) < 1e-5


def test_bad_shapes_raise_one_clear_error():
    q, keys, values, visible, slots = case(1, 4, 2, 32, 64, 10, seed=0)
    assert not da.supports(q[..., :24], keys[..., :24])  # not a power of two
    with pytest.raises(ValueError, match="decode attention takes"):
        da.decode_attention_triton(q, keys, values[:, :32], visible, slots)
    with pytest.raises(ValueError, match="decode attention takes"):
        da.decode_attention_triton(q, keys, values, visible[:, :32], slots)
    big = torch.zeros(17, 4, 32, device=q.device)
    assert not da.supports(big, keys)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 8, 16])
@pytest.mark.parametrize("past", [0, 4000, 16384])
@pytest.mark.parametrize("chunk", [64, 256])
def test_cuda_real_shapes(T, past, chunk):
    """Qwen3.6-35B-A3B's attention: 16 query heads on 2 KV heads of 256, a 20K-slot bf16 cache."""
    q, keys, values, visible, slots = case(T, 16, 2, 256, 20480, past, seed=past + T, dtype=torch.bfloat16)
    ref = grouped_attention(q.float(), keys.float(), values.float(), visible)
    assert rel_err(da.decode_attention_triton(q, keys, values, visible, slots, chunk=chunk), ref) < 2e-2
    q32, k32, v32 = q.float(), keys.float(), values.float()
    assert rel_err(da.decode_attention_triton(q32, k32, v32, visible, slots, chunk=chunk), ref) < 1e-4
