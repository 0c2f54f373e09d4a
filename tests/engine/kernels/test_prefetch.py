"""The kernels that load inputs before their PDL wait (``engine.kernels.pdl.PREFETCH``) give the same bits
with the prefetch on and off: the router (its weight rows in one tile, and in several where it does not
prefetch), the delta rule (its state, with and without the gated norm) and the experts' down launch per
pair (its ids and codes). On the CPU through the Triton interpreter, where the wait does nothing and the
prefetching code runs as written; that the loads do come before the wait is checked in the machine code
(``test_rows_compile.py``)."""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

from engine.kernels import pdl  # noqa: E402

moe_gate = pytest.importorskip("engine.kernels.moe_gate")
gdn_decode = pytest.importorskip("engine.kernels.gdn_decode")
tq = pytest.importorskip("engine.kernels.quant.triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def both(monkeypatch):
    """``run(fn)``: fn() with the prefetch off, then on; returns both results."""

    def run(fn):
        out = []
        for on in (False, True):
            monkeypatch.setattr(pdl, "PREFETCH", on)
            out.append(fn())
        return out

    return run


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return all(_same(x, y) for x, y in zip(a, b, strict=True))


def test_the_switch(monkeypatch):
    monkeypatch.setattr(pdl, "PREFETCH", None)
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)
    assert pdl.prefetch()
    monkeypatch.setenv(pdl.PREFETCH_ENV, "0")
    assert not pdl.prefetch()
    monkeypatch.setattr(pdl, "PREFETCH", True)
    assert pdl.prefetch()


@pytest.mark.parametrize("T, E, H, k", [(1, 60, 200, 2), (1, 37, 96, 4), (3, 256, 2048, 8)],
                         ids=["one-tile", "odd", "four-tiles"])
@pytest.mark.parametrize("add_norm", [True, False], ids=["add-norm", "plain"])
def test_router_bits(both, T, E, H, k, add_norm):
    g = torch.Generator().manual_seed(T * E + H)
    h, r = (torch.randn(T, H, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    norm_weight = (1 + 0.2 * torch.randn(H, generator=g)).to(DEVICE)
    router = torch.randn(E, H, generator=g).to(DEVICE) * H ** -0.5 * 4
    if add_norm:
        off, on = both(lambda: moe_gate.add_norm_route_triton(h, r, norm_weight, 1e-6, router, k))
    else:
        off, on = both(lambda: moe_gate.route_triton(h, router, k))
    assert _same(off, on)


@pytest.mark.parametrize("T, H, dk, dv, block_v", [(1, 3, 64, 64, 32), (4, 5, 128, 128, 32), (2, 1, 24, 40, 16)])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "plain"])
def test_delta_rule_bits(both, T, H, dk, dv, block_v, norm):
    g = torch.Generator().manual_seed(T + H + dk)
    q, k = (torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(T, H, dv, generator=g)
    gate = -torch.rand(T, H, generator=g) - 1e-3
    beta = torch.rand(T, H, generator=g).clamp(1e-3, 1 - 1e-3)
    state = torch.randn(H, dk, dv, generator=g)
    z = torch.randn(T, H, dv, generator=g)
    weight = 1 + 0.1 * torch.randn(dv, generator=g)
    args = [t.to(DEVICE) for t in (q, k, v, gate, beta, state, z, weight)]
    extra = {"norm": (args[6], args[7], 1e-6, torch.float32)} if norm else {}
    off, on = both(lambda: gdn_decode.delta_rule_decode_triton(*args[:6], dk ** -0.5, block_v=block_v, **extra))
    assert _same(off, on)


@pytest.mark.parametrize("T, with_shared", [(1, True), (3, False)])
def test_down_per_pair_bits(both, T, with_shared):
    from gguf import GGMLQuantizationType as Q

    from engine.gguf.quants import random_quantized
    from engine.kernels.quant import QuantExperts, QuantMatrix

    hidden, ffn, E, top_k = 96, 64, 5, 3
    rng = np.random.default_rng(T)
    stack = [QuantExperts.from_gguf_bytes(random_quantized((E, n, kk), Q.Q4_0, rng, 0.05), Q.Q4_0, E, n, kk)
             .to(DEVICE).with_layout("split") for n, kk in ((ffn, hidden), (ffn, hidden), (hidden, ffn))]
    shared = None
    if with_shared:
        s_gu = QuantMatrix.from_gguf_bytes(random_quantized((2 * ffn, hidden), Q.Q4_0, rng, 0.05), Q.Q4_0, 2 * ffn,
                                           hidden).to(DEVICE).with_layout("split")
        s_down = QuantMatrix.from_gguf_bytes(random_quantized((hidden, ffn), Q.Q4_0, rng, 0.05), Q.Q4_0, hidden,
                                             ffn).to(DEVICE).with_layout("split")
        shared = (s_gu, s_down, torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 0.1)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, hidden, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(DEVICE)
    ids[0, 1] = -1  # a pair routed nowhere
    w = torch.softmax(torch.randn(T, top_k, generator=g), -1).to(DEVICE)
    up = tq.QuantKernelConfig(gemv_block_n=8, gemv_block_k=64)
    per_pair = tq.QuantKernelConfig(gemv_block_n=64, gemv_block_k=64, gemv_pair_split=1)  # K in one tile
    off, on = both(lambda: tq.quantized_moe_triton(x, *stack, ids, w, up, per_pair, shared=shared))
    assert _same(off, on)
    per_token = tq.QuantKernelConfig(gemv_block_n=64, gemv_block_k=64)  # the per-token sum, bit for bit
    assert torch.equal(tq.quantized_moe_triton(x, *stack, ids, w, up, per_token, shared=shared), on)
