"""Routed experts gathered into a device buffer (``engine.kernels.gather``): every routed pair's slab
copied whole, bit for bit, pairs routed nowhere left untouched; uint8 blocks, bf16 and float32 stacks,
slabs of whole words and of odd bytes; on the CPU through the Triton interpreter, on CUDA from a mapped
view of pinned host memory."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated

gather = pytest.importorskip("engine.kernels.gather")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def stack(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype,shape", [(torch.uint8, (7, 5, 36)), (torch.uint8, (6, 3, 7)),
                                         (torch.bfloat16, (5, 4, 9)), (torch.float32, (4, 3, 1500))])
def test_routed_slabs_copied_whole_and_unrouted_rows_untouched(dtype, shape):
    src = stack(shape, dtype, seed=shape[0]).to(DEVICE)
    dst = torch.zeros((8, *shape[1:]), dtype=dtype, device=DEVICE)
    ids = torch.tensor([3, -1, 0, shape[0] - 1, 3, -1], device=DEVICE)
    gather.gather_experts(src, dst, ids)
    for p, e in enumerate(ids.tolist()):
        expected = src[e] if e >= 0 else torch.zeros_like(src[0])
        assert torch.equal(dst[p].view(torch.uint8), expected.view(torch.uint8)), (p, e)
    assert not dst[len(ids):].view(torch.uint8).any()


def test_refuses_mismatched_stacks_and_ids():
    src = torch.zeros(4, 3, 8, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype and shape"):
        gather.gather_experts(src, torch.zeros(4, 3, 9, dtype=torch.uint8, device=DEVICE),
                              torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="one dtype and shape"):
        gather.gather_experts(src, torch.zeros(4, 3, 8, dtype=torch.int8, device=DEVICE),
                              torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="at most 2 pairs"):
        gather.gather_experts(src, torch.zeros(2, 3, 8, dtype=torch.uint8, device=DEVICE),
                              torch.zeros(3, dtype=torch.long, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gathers_from_mapped_host_memory_in_a_graph():
    """The 35B shapes' Q4_0 gate slabs (512 rows of 1,152 bytes) read from a mapped view of pinned host
    memory, eagerly and replayed in a CUDA graph with new routing."""
    from engine.hybrid import mapped_view

    host = stack((16, 512, 1152), torch.uint8, seed=1).pin_memory()
    src = mapped_view(host, torch.device("cuda"))
    dst = torch.zeros(8, 512, 1152, dtype=torch.uint8, device="cuda")
    ids = torch.tensor([5, -1, 15, 0, 7, -1, 2, 9], device="cuda")
    gather.gather_experts(src, dst, ids)
    torch.cuda.synchronize()
    assert torch.equal(dst[0].cpu(), host[5]) and torch.equal(dst[2].cpu(), host[15])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gather.gather_experts(src, dst, ids)
    ids.copy_(torch.tensor([1, 3, -1, 4, 6, 8, 10, 12], device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(dst[p].cpu(), host[e]) for p, e in enumerate([1, 3, -1, 4, 6, 8, 10, 12]) if e >= 0)
