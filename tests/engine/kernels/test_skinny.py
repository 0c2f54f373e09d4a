"""The few-row float32 projection (``engine.kernels.skinny``) against ``F.linear`` in float64 on
fresh random inputs at odd sizes; its dispatch in ``engine.model.linear``; on the CPU through the
Triton interpreter, on CUDA at the shipped model's shapes and inside a CUDA graph."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated

skinny = pytest.importorskip("engine.kernels.skinny")
from engine.errors import ConfigError  # noqa: E402
from engine.model import linear as linear_mod  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(m, n, k, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k * (2 if strided else 1), generator=g).to(DEVICE)
    if strided:  # rows of a wider tensor, as a split projection hands them on (sliced on the device: a copy
        x = x[:, 1:k + 1]  # to CUDA would make them contiguous)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return x, w.to(DEVICE)


def max_rel(out, x, w):
    ref = F.linear(x.double(), w.double())
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 16, 17, 32])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (33, 64), (130, 65), (257, 200), (2049, 300)])
def test_matches_float64_reference(m, n, k):
    """Both kernels: fewer than FEW_M rows take the few-row kernel (its default tile), the others the tl.dot one."""
    x, w = case(m, n, k, seed=m * 1000 + n + k)
    out = skinny.skinny_linear(x, w)
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
    assert max_rel(out, x, w) < 1e-5


def test_leading_dims_and_strided_rows():
    x, w = case(6, 19, 37, seed=3, strided=True)
    assert x.stride(0) != x.shape[1]
    assert max_rel(skinny.skinny_linear(x, w), x, w) < 1e-5
    x3 = torch.randn(2, 5, 37, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = skinny.skinny_linear(x3, w)
    assert out.shape == (2, 5, 19)
    assert max_rel(out.reshape(10, 19), x3.reshape(10, 37), w) < 1e-5


@pytest.mark.parametrize("tile", [(1, 16, 1), (2, 256, 1), (4, 32, 2), (16, 64, 4)])
@pytest.mark.parametrize("m,n,k", [(1, 7, 5), (2, 33, 300), (5, 130, 64), (7, 9, 513), (9, 11, 100), (17, 7, 130)])
def test_rows_kernel_matches_float64_at_every_tile(m, n, k, tile):
    """The few-row kernel at other tiles than the default: outputs not a multiple of the programs' width, K
    not a multiple of the chunk (several chunks, a partial last one), row counts below FEW_M and, for
    LUCE_TUNE_FEW_ROWS, the verify blocks of spec_len 8 and 16."""
    x, w = case(m, n, k, seed=m * 97 + n * 7 + k + tile[0])
    out = skinny.rows_linear(x, w, *tile)
    assert out.shape == (m, n) and out.is_contiguous()
    assert max_rel(out, x, w) < 1e-5


def test_rows_tile_setting(monkeypatch):
    monkeypatch.delenv(skinny.ROWS_TILE_ENV, raising=False)
    assert skinny.rows_tiles() == skinny.ROWS_TILE == (2, 256, 1)
    monkeypatch.setenv(skinny.ROWS_TILE_ENV, "8, 64, 4")
    assert skinny.rows_tiles() == (8, 64, 4)
    for bad in ("3,256,1", "2,8,1", "2,256,16", "2,256", "two"):
        monkeypatch.setenv(skinny.ROWS_TILE_ENV, bad)
        with pytest.raises(ConfigError, match=f"LUCE_TUNE_ROWS_TILE takes three powers of two.*got '{bad}'"):
            skinny.rows_tiles()
    linear_refuses(monkeypatch, "LUCE_TUNE_ROWS_TILE")


def linear_refuses(monkeypatch, name):
    """Through ``linear``, a bad setting ``name`` is one clear error at every call (not read once and then passed
    over), raised before the kernel's attempt (which, on CUDA without a forced setting, would switch the kernel off
    and fall back instead of raising)."""
    attempts = []
    monkeypatch.setattr(linear_mod.fused, "attempt", lambda *a: attempts.append(a) or None)
    monkeypatch.setattr(linear_mod, "FUSED_SKINNY", True)
    monkeypatch.setattr(linear_mod, "_MIN_ROWS", None)
    x, w = case(4, 8, 16, seed=9)
    for _ in range(2):
        with pytest.raises(ConfigError, match=name):
            linear_mod.linear(x, w)
    assert attempts == []
    monkeypatch.setattr(linear_mod, "_MIN_ROWS", None)


def test_the_few_rows_kernel_is_taken_below_few_m(monkeypatch):
    """Fewer than FEW_M rows launch the few-row kernel with the row count compiled in, one program per
    ROWS_TILE[0] outputs; FEW_M and more the tl.dot kernel."""
    launched = []
    rows, dot = skinny._rows_kernel, skinny._skinny_kernel

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((self.name, grid, kwargs.get("M")))
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.delenv(skinny.ROWS_TILE_ENV, raising=False)
    monkeypatch.delenv(skinny.FEW_ROWS_ENV, raising=False)
    monkeypatch.setattr(skinny, "_in_use", None)  # read again from the (unset) settings
    monkeypatch.setattr(skinny, "_rows_kernel", Spy("rows", rows))
    monkeypatch.setattr(skinny, "_skinny_kernel", Spy("dot", dot))
    x, w = case(skinny.FEW_M, 24, 40, seed=11)
    assert max_rel(skinny.skinny_linear(x[:skinny.FEW_M - 1], w), x[:skinny.FEW_M - 1], w) < 1e-5
    skinny.skinny_linear(x, w)
    assert launched == [("rows", (24 // skinny.ROWS_TILE[0],), skinny.FEW_M - 1), ("dot", (2, 1), None)]
    # the default sends the verify blocks of spec_len 8 and 16 (9 and 17 rows) to the few-row kernel
    assert skinny.FEW_M == 18
    # LUCE_TUNE_FEW_ROWS=8 (the earlier bound): blocks of 8 to 17 rows take the tl.dot kernel, 7 not
    launched.clear()
    monkeypatch.setenv(skinny.FEW_ROWS_ENV, "8")
    monkeypatch.setattr(skinny, "_in_use", None)
    x, w = case(18, 24, 40, seed=12)
    for m in (7, 8, 9, 17):
        assert max_rel(skinny.skinny_linear(x[:m], w), x[:m], w) < 1e-5
    assert [(name, m) for name, _, m in launched] == [("rows", 7), ("dot", None), ("dot", None), ("dot", None)]
    monkeypatch.setattr(skinny, "_in_use", None)


def test_few_rows_setting(monkeypatch):
    """``LUCE_TUNE_FEW_ROWS``: FEW_M when unset, 2 to MAX_M + 1 otherwise, one clear error for anything else,
    also through ``linear`` before the kernel's attempt."""
    monkeypatch.delenv(skinny.FEW_ROWS_ENV, raising=False)
    assert skinny.few_rows() == skinny.FEW_M == 18
    for good in ("2", "18", str(skinny.MAX_M + 1)):
        monkeypatch.setenv(skinny.FEW_ROWS_ENV, good)
        assert skinny.few_rows() == int(good)
    for bad in ("1", str(skinny.MAX_M + 2), "nine", "8.5"):
        monkeypatch.setenv(skinny.FEW_ROWS_ENV, bad)
        with pytest.raises(ConfigError, match=f"LUCE_TUNE_FEW_ROWS must be a whole number from 2 to 33.*got '{bad}'"):
            skinny.few_rows()
    linear_refuses(monkeypatch, "LUCE_TUNE_FEW_ROWS")


def test_refuses_what_it_does_not_take():
    x, w = case(4, 8, 16, seed=5)
    assert skinny.applies(x, w)
    assert skinny.applies(x[:1], w)
    assert not skinny.applies(x[:0], w)
    assert not skinny.applies(torch.randn(skinny.MAX_M + 1, 16, device=DEVICE), w)  # prefill: cuBLAS
    assert not skinny.applies(x.bfloat16(), w.bfloat16())
    assert not skinny.applies(x, w.t().contiguous().t())  # weight columns not contiguous
    assert not skinny.applies(x, w.requires_grad_(True))  # autograd: draft training
    with pytest.raises(ValueError, match="skinny_linear takes"):
        skinny.skinny_linear(x[:0], w.detach())


def test_linear_dispatch(monkeypatch):
    """``linear`` takes the kernel when told to (or on CUDA by itself) and ``F.linear`` otherwise: the
    same values within float32 rounding, and the kernel's launch really taken."""
    x, w = case(9, 40, 96, seed=6)
    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(linear_mod, "FUSED_SKINNY", True)
    on = linear_mod.linear(x, w)
    assert calls == [1]
    monkeypatch.setattr(linear_mod, "FUSED_SKINNY", False)
    off = linear_mod.linear(x, w)
    assert calls == [1]
    assert (on - off).abs().max().item() <= 1e-5 * off.abs().max().item()
    monkeypatch.setattr(linear_mod, "FUSED_SKINNY", True)
    monkeypatch.delenv(linear_mod.SKINNY_MIN_ROWS_ENV, raising=False)
    monkeypatch.setattr(linear_mod, "_MIN_ROWS", None)
    fewest = linear_mod.DEFAULT_MIN_ROWS
    linear_mod.linear(x[:fewest - 1], w)  # fewer rows (the decode step's one): F.linear
    assert calls == [1]
    linear_mod.linear(x[:fewest], w)
    assert calls == [1, 1]


def test_linear_min_rows_setting(monkeypatch):
    """``LUCE_TUNE_SKINNY_MIN_ROWS`` moves the fewest rows ``linear`` sends to the kernels (read once), and a
    value outside 1-32 is one clear error."""
    x, w = case(9, 40, 96, seed=7)
    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(linear_mod, "FUSED_SKINNY", True)
    monkeypatch.setenv(linear_mod.SKINNY_MIN_ROWS_ENV, "2")
    monkeypatch.setattr(linear_mod, "_MIN_ROWS", None)
    out = linear_mod.linear(x[:5], w)
    assert max_rel(out, x[:5], w) < 1e-5
    linear_mod.linear(x[:1], w)
    assert calls == [5]
    monkeypatch.setenv(linear_mod.SKINNY_MIN_ROWS_ENV, "1")
    linear_mod.linear(x[:1], w)
    assert calls == [5]  # read once: the first value holds
    monkeypatch.setattr(linear_mod, "_MIN_ROWS", None)
    linear_mod.linear(x[:1], w)
    assert calls == [5, 1]
    for bad in ("0", "33", "eight", "2.5"):
        monkeypatch.setenv(linear_mod.SKINNY_MIN_ROWS_ENV, bad)
        monkeypatch.setattr(linear_mod, "_MIN_ROWS", None)
        with pytest.raises(ConfigError, match=f"LUCE_TUNE_SKINNY_MIN_ROWS must be a whole number of rows from 1 "
                                              f"to 32, got '{bad}'"):
            linear_mod.linear(x[:5], w)
    monkeypatch.setattr(linear_mod, "_MIN_ROWS", None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("few", [None, "18"], ids=["default", "few18"])
@pytest.mark.parametrize("m", [1, 2, 5, 9, 17])
@pytest.mark.parametrize("n,k", [(4096, 256), (1024, 256), (256, 768), (32, 256), (8, 256)])
def test_cuda_shapes_in_a_graph(m, n, k, few, monkeypatch):
    """The shipped target's and draft's projections (LM head, qkv, fc, router, alpha/beta) for one row and
    verify blocks of 1, 4, 8 and 16 tokens (below FEW_M through the few-row kernel, all of them with
    ``LUCE_TUNE_FEW_ROWS=18``): eager and replayed in a CUDA graph on new rows."""
    if few is None:
        monkeypatch.delenv(skinny.FEW_ROWS_ENV, raising=False)
    else:
        monkeypatch.setenv(skinny.FEW_ROWS_ENV, few)
    monkeypatch.setattr(skinny, "_in_use", None)
    x, w = case(m, n, k, seed=m + n + k)
    assert max_rel(skinny.skinny_linear(x, w), x, w) < 1e-5
    static = x.clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = skinny.skinny_linear(static, w)
    fresh = torch.randn_like(x)
    static.copy_(fresh)
    g.replay()
    torch.cuda.synchronize()
    assert max_rel(out, fresh, w) < 1e-5
