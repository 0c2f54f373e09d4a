"""Gated delta rule: chunked form and fla kernels against the token-by-token definition; the
causal conv and the recurrent state carried across calls."""

import pytest
import torch

from engine.model.gated_deltanet import (DeltaRule, causal_conv, delta_rule_chunked, delta_rule_recurrent,
                                         l2norm)

TOL = 2e-5  # float32, max abs error relative to the largest output / state value


def inputs(T: int, H: int = 3, dk: int = 8, dv: int = 5, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = l2norm(rand(T, H, dk))
    k = l2norm(rand(T, H, dk))
    v = rand(T, H, dv)
    g = -torch.rand(T, H, generator=gen) * 2.0  # log decays in (-2, 0]
    beta = torch.rand(T, H, generator=gen)
    state = rand(H, dk, dv)
    return [t.to(device) for t in (q, k, v, g, beta, state)]


def close(out, ref) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("T", [1, 2, 5, 63, 64, 65, 130])
def test_chunked_matches_recurrent(T):
    q, k, v, g, beta, s0 = inputs(T, seed=T)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, s0, 8 ** -0.5)
    o, s = delta_rule_chunked(q, k, v, g, beta, s0, 8 ** -0.5)
    assert close(o, o_ref) <= TOL
    assert close(s, s_ref) <= TOL


def test_chunked_with_small_chunks_and_strong_decay():
    q, k, v, g, beta, s0 = inputs(50, seed=7)
    g = g * 20  # decays down to exp(-40) per token: the intra-chunk exponentials must not overflow
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, s0, 0.3)
    o, s = delta_rule_chunked(q, k, v, g, beta, s0, 0.3, chunk=16)
    assert torch.isfinite(o).all()
    assert close(o, o_ref) <= TOL and close(s, s_ref) <= TOL


def test_recurrent_matches_explicit_definition():
    q, k, v, g, beta, s0 = inputs(4, H=1, dk=3, dv=2, seed=5)
    o, s = delta_rule_recurrent(q, k, v, g, beta, s0, 1.0)
    S = s0[0].clone()
    for t in range(4):
        S = torch.exp(g[t, 0]) * S
        u = beta[t, 0] * (v[t, 0] - S.T @ k[t, 0])
        S = S + torch.outer(k[t, 0], u)
        torch.testing.assert_close(o[t, 0], S.T @ q[t, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(s[0], S, rtol=0, atol=1e-6)


@pytest.mark.parametrize("split", [1, 30, 64])
def test_state_carries_across_calls(split):
    q, k, v, g, beta, s0 = inputs(100, seed=11)
    o_ref, s_ref = delta_rule_chunked(q, k, v, g, beta, s0, 0.35)
    rule = DeltaRule.select("cpu")
    o1, s1 = rule(q[:split], k[:split], v[:split], g[:split], beta[:split], s0, 0.35)
    o2, s2 = rule(q[split:], k[split:], v[split:], g[split:], beta[split:], s1, 0.35)
    assert close(torch.cat([o1, o2]), o_ref) <= TOL and close(s2, s_ref) <= TOL


def test_causal_conv_continues_from_its_state():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, 6, generator=gen)
    w = torch.randn(6, 4, generator=gen)
    zero = torch.zeros(6, 3)
    full, state = causal_conv(x, zero, w)
    # definition: out[t, c] = sum_j w[c, j] * x[t - 3 + j, c], zero before the start
    padded = torch.cat([zero.T, x])
    ref = torch.stack([(w.T * padded[t:t + 4]).sum(0) for t in range(11)])
    torch.testing.assert_close(full, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, x[-3:].T)
    out = []
    s = zero
    for chunk in (x[:2], x[2:3], x[3:]):
        o, s = causal_conv(chunk, s, w)
        out.append(o)
    torch.testing.assert_close(torch.cat(out), full, rtol=0, atol=1e-6)
    torch.testing.assert_close(s, state)


def test_torch_backend_is_chosen_on_cpu_and_when_forced():
    assert DeltaRule.select("cpu").backend == "torch"
    assert DeltaRule.select("cuda", force_torch=True).backend == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 3, 65, 300])
@pytest.mark.parametrize("v_dtype, tol", [
    (torch.float32, 5e-3),  # measured on an H200: <= 1.6e-3 (the chunk kernel's products are tf32-like)
    (torch.bfloat16, 2e-2),  # v in bf16 as the model feeds it: measured <= 8.3e-3
])
def test_fla_kernels_match_the_torch_reference(T, v_dtype, tol):
    pytest.importorskip("fla")
    rule = DeltaRule.select("cuda")
    assert rule.backend == "fla"
    q, k, v, g, beta, s0 = inputs(T, H=32, dk=128, dv=128, seed=T, device="cuda")
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, s0, 128 ** -0.5)
    o, s = rule(q, k, v.to(v_dtype), g, beta, s0, 128 ** -0.5)
    assert close(o.float(), o_ref) <= tol and close(s, s_ref) <= tol


@pytest.mark.parametrize("T, dk, expected", [(1, 8, "short"), (16, 8, "short"), (17, 8, "chunk"),
                                             (3, 200, "recurrent"), (9, 200, "chunk")])
def test_short_calls_go_to_the_short_kernel(T, dk, expected):
    """Calls of at most SHORT_MAX_TOKENS tokens whose heads fit go to ``short``; the others keep
    the recurrent/chunk split, and every path returns what the definition does."""
    seen = []

    def spy(name, fn):
        def run(*args):
            seen.append(name)
            return fn(*args)
        return run

    rule = DeltaRule(spy("chunk", delta_rule_chunked), spy("recurrent", delta_rule_recurrent), "torch",
                     short=spy("short", delta_rule_recurrent), short_head_dim=128)
    assert rule.name == "triton+torch"
    q, k, v, g, beta, s0 = inputs(T, dk=dk, seed=T)
    o, s = rule(q, k, v, g, beta, s0, dk ** -0.5)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, s0, dk ** -0.5)
    assert seen == [expected]
    assert close(o, o_ref) <= TOL and close(s, s_ref) <= TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rule_sends_verify_blocks_to_the_triton_kernel():
    pytest.importorskip("triton")
    rule = DeltaRule.select("cuda")
    assert rule.short is not None and rule.name.startswith("triton+")
    q, k, v, g, beta, s0 = inputs(9, H=32, dk=128, dv=128, seed=4, device="cuda")
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, s0, 128 ** -0.5)
    o, s = rule(q, k, v, g, beta, s0, 128 ** -0.5)
    assert close(o.float(), o_ref) <= 1e-5 and close(s, s_ref) <= 1e-5
