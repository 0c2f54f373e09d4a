"""Router, the reference expert executor and the shared expert against a dense computation."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are decorated

from engine.model.config import ModelConfig  # noqa: E402
from engine.model.moe import TorchExpertExecutor, expert_ffn, moe_forward, route  # noqa: E402
from engine.model.weights import ExpertWeights, MoEWeights, SharedExpertWeights  # noqa: E402

E, H, F, K = 6, 16, 8, 2


def _cfg() -> ModelConfig:
    return ModelConfig(n_layers=4, hidden=H, vocab=10, n_head=2, n_head_kv=1, head_dim=4, rms_eps=1e-6,
                       rope_theta=1e4, rope_dim=2, n_expert=E, n_expert_used=K, expert_ffn=F, shared_ffn=F,
                       conv_kernel=4, gdn_k_heads=1, gdn_v_heads=1, gdn_head_k=4, gdn_head_v=4,
                       full_attention_interval=4)


def _weights(seed=0) -> MoEWeights:
    gen = torch.Generator().manual_seed(seed)

    def rand(*s):
        return torch.randn(*s, generator=gen) * 0.5

    experts = ExpertWeights(gate=rand(E, F, H), up=rand(E, F, H), down=rand(E, H, F))
    shared = SharedExpertWeights(gate=rand(F, H), up=rand(F, H), down=rand(H, F), gate_inp=rand(H))
    return MoEWeights(router=rand(E, H), experts=experts, shared=shared)


def test_route_is_softmax_topk_renormalised():
    w = _weights()
    x = torch.randn(5, H)
    ids, weights = route(w.router, x, K)
    probs = torch.softmax(x @ w.router.T, -1)
    for t in range(5):
        top = probs[t].argsort(descending=True)[:K]
        assert ids[t].tolist() == top.tolist()
        torch.testing.assert_close(weights[t], probs[t, top] / probs[t, top].sum())


def test_moe_matches_dense_computation_and_reports_routing():
    w = _weights(1)
    x = torch.randn(7, H)
    seen = []
    out = moe_forward(w, x, 3, _cfg(), TorchExpertExecutor({3: w.experts}), lambda i, ids: seen.append((i, ids)))
    ids, weights = route(w.router, x, K)
    ref = torch.zeros(7, H)
    for t in range(7):
        for j in range(K):
            ref[t] += weights[t, j] * expert_ffn(x[t], *w.experts.expert(int(ids[t, j])))
    s = w.shared
    ref += torch.sigmoid(x @ s.gate_inp)[:, None] * expert_ffn(x, s.gate, s.up, s.down)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert len(seen) == 1 and seen[0][0] == 3 and torch.equal(seen[0][1], ids)


def test_only_routed_experts_are_computed():
    w = _weights(2)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1))  # seeded: its 6 picks leave an expert unused
    ids, weights = route(w.router, x, K)
    unused = sorted(set(range(E)) - set(ids.flatten().tolist()))
    assert unused
    for e in unused:  # an unrouted expert full of NaN must not reach the output
        w.experts.gate[e] = float("nan")
    out = TorchExpertExecutor([w.experts])(0, x, ids, weights)
    assert torch.isfinite(out).all()


def test_swiglu_takes_the_kernel_where_the_fused_gate_applies(monkeypatch):
    """``swiglu``: torch's silu(gate) * up off CUDA; with the fused gate forced (the Triton interpreter on the CPU)
    the one-launch kernel on halves of one product's rows (odd width, rows strided by the product), the same
    values; rows it cannot take (a strided last dimension, more than ``GATE_MAX_TOKENS``) go to torch."""
    from engine.model import moe

    gen = torch.Generator().manual_seed(4)
    gate, up = torch.randn(5, 2 * 37, generator=gen).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    if not torch.cuda.is_available():
        torch.testing.assert_close(moe.swiglu(gate, up), want, rtol=0, atol=0)
    pytest.importorskip("triton")
    monkeypatch.setattr(moe, "FUSED_GATE", True)
    calls = []
    kernels = moe._gate_kernels()
    kernel = kernels.swiglu_triton
    monkeypatch.setattr(kernels, "swiglu_triton", lambda g, u: calls.append(1) or kernel(g, u))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.testing.assert_close(moe.swiglu(gate.to(dev), up.to(dev)).cpu(), want, rtol=1e-6, atol=1e-6)
    assert calls == [1]
    wide = torch.randn(5, 37, 2, generator=gen)[..., 0]  # last dimension strided
    torch.testing.assert_close(moe.swiglu(wide, wide), torch.nn.functional.silu(wide) * wide)
    many = torch.randn(moe.GATE_MAX_TOKENS + 1, 8, generator=gen)
    torch.testing.assert_close(moe.swiglu(many, many), torch.nn.functional.silu(many) * many)
    assert calls == [1]
