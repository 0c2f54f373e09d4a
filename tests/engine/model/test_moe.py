"""Router, the reference expert executor and the shared expert against a dense computation."""

import torch

from engine.model.config import ModelConfig
from engine.model.moe import TorchExpertExecutor, expert_ffn, moe_forward, route
from engine.model.weights import ExpertWeights, MoEWeights, SharedExpertWeights

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
    x = torch.randn(3, H)
    ids, weights = route(w.router, x, K)
    unused = sorted(set(range(E)) - set(ids.flatten().tolist()))
    assert unused
    for e in unused:  # an unrouted expert full of NaN must not reach the output
        w.experts.gate[e] = float("nan")
    out = TorchExpertExecutor([w.experts])(0, x, ids, weights)
    assert torch.isfinite(out).all()
