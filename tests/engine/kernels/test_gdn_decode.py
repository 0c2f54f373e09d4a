"""Gated delta rule decode kernel against the token-by-token torch definition: odd head counts
and head sizes on the CPU (Triton interpreter), the real Qwen3.6-35B-A3B shape on CUDA, where
it is also compared with fla's fused_recurrent kernel.

Errors are max-abs over the largest reference value. The kernel computes in float32 from the
same (possibly bf16) inputs as the reference, so only summation order and exp differ: 1e-5 in
the interpreter, 1e-4 on the GPU. fla casts q and k to v's dtype, hence its looser bound.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated

from engine.model.gated_deltanet import DeltaRule, delta_rule_recurrent, l2norm  # noqa: E402

gdn_decode = pytest.importorskip("engine.kernels.gdn_decode")
delta_rule_decode_triton = gdn_decode.delta_rule_decode_triton
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOL_CPU = 1e-5
TOL_GPU = 1e-4


def inputs(T, H, dk, dv, *, v_dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, H, dk, generator=gen))
    k = l2norm(torch.randn(T, H, dk, generator=gen))
    v = torch.randn(T, H, dv, generator=gen).to(v_dtype)
    g = -torch.rand(T, H, generator=gen) * 2.0 - 1e-3  # log decays in (-2, 0)
    beta = torch.rand(T, H, generator=gen).clamp(1e-3, 1 - 1e-3)
    state = torch.randn(H, dk, dv, generator=gen)
    return [t.to(device) for t in (q, k, v, g, beta, state)]


def rel_err(out, ref) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


CASES = [  # (T, H, dk, dv): every T in 1..4, H in (1, 3, 5), head sizes 32/64/128 and non-powers of two
    (1, 1, 32, 32), (2, 3, 64, 64), (3, 5, 128, 128), (4, 3, 32, 128),
    (4, 1, 128, 64), (1, 5, 64, 32), (3, 3, 24, 40), (2, 1, 128, 17),
]


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T, H, dk, dv", CASES)
def test_matches_reference(T, H, dk, dv, v_dtype):
    q, k, v, g, beta, s0 = inputs(T, H, dk, dv, v_dtype=v_dtype, seed=T * 100 + H * 10 + dv)
    s_before = s0.clone()
    o, s = delta_rule_decode_triton(q, k, v, g, beta, s0, dk ** -0.5)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, s0, dk ** -0.5)
    assert o.shape == (T, H, dv) and o.dtype == o_ref.dtype == torch.float32
    assert s.shape == (H, dk, dv) and s.dtype == torch.float32
    assert rel_err(o, o_ref) <= TOL_CPU
    assert rel_err(s, s_ref) <= TOL_CPU
    assert torch.equal(s0, s_before)


@pytest.mark.parametrize("block_v", [8, 16, 64])
def test_value_blocks_and_in_place_state(block_v):
    q, k, v, g, beta, s0 = inputs(3, 3, 64, 72, seed=block_v)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, s0, 0.3)
    o, s = delta_rule_decode_triton(q, k, v, g, beta, s0, 0.3, out_state=s0, block_v=block_v)
    assert s.data_ptr() == s0.data_ptr()
    assert rel_err(o, o_ref) <= TOL_CPU and rel_err(s0, s_ref) <= TOL_CPU


def test_strided_inputs_as_the_mixer_feeds_them():
    """v is a column slice of the conv output, g and beta columns of wider tensors, the state a
    view of a larger buffer: strides are honoured, not assumed."""
    T, H, dk, dv = 2, 3, 32, 48
    q, k, v, g, beta, s0 = inputs(T, H, dk, dv, seed=5)
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1)
    v_view = mixed[:, 2 * H * dk:].view(T, H, dv)
    gb = torch.stack([g, beta], dim=-1)
    big = torch.zeros(2, H, dk, dv)
    big[1] = s0
    o, s = delta_rule_decode_triton(q, k, v_view, gb[..., 0], gb[..., 1], big[1], 0.2, out_state=big[1])
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, s0, 0.2)
    assert rel_err(o, o_ref) <= TOL_CPU and rel_err(big[1], s_ref) <= TOL_CPU
    assert not big[0].any()


def test_consecutive_steps_carry_the_state():
    q, k, v, g, beta, s0 = inputs(4, 3, 32, 32, seed=9)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, s0, 0.25)
    s = s0.clone()
    outs = []
    for t in range(4):
        o, s = delta_rule_decode_triton(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s, 0.25)
        outs.append(o)
    assert rel_err(torch.cat(outs), o_ref) <= TOL_CPU and rel_err(s, s_ref) <= TOL_CPU


@pytest.mark.parametrize("T, H, dk, dv, block_v, norm", [
    (1, 1, 32, 32, 32, False), (3, 3, 24, 40, 16, True), (5, 2, 64, 17, 8, False), (16, 1, 16, 48, 16, True),
])
def test_per_token_states_are_the_state_after_each_token(T, H, dk, dv, block_v, norm):
    """``states=``: the state after token t in row t, as the definition leaves it after the first t + 1
    tokens (odd head sizes, several value blocks, the norm's launch too), into a strided view of a larger
    buffer (a layer's row of a verify step's stack); the last row is the new state, the output unchanged."""
    q, k, v, g, beta, s0 = inputs(T, H, dk, dv, seed=T * 7 + dv)
    big = torch.full((3, T, H, dk, dv), float("nan"))
    kw = {"norm": (torch.randn(T, H, dv), torch.rand(dv) + 0.5, 1e-6, torch.float32)} if norm else {}
    o_plain, s_plain = delta_rule_decode_triton(q, k, v, g, beta, s0, dk ** -0.5, block_v=block_v, **kw)
    o, s = delta_rule_decode_triton(q, k, v, g, beta, s0, dk ** -0.5, block_v=block_v, states=big[1], **kw)
    assert torch.equal(o, o_plain) and torch.equal(s, s_plain)
    assert torch.equal(big[1, -1], s)
    assert big[0].isnan().all() and big[2].isnan().all()
    ref_states = torch.empty(T, H, dk, dv)
    delta_rule_recurrent(q, k, v, g, beta, s0, dk ** -0.5, states=ref_states)
    for t in range(T):
        _, s_ref = delta_rule_recurrent(q[:t + 1], k[:t + 1], v[:t + 1], g[:t + 1], beta[:t + 1], s0, dk ** -0.5)
        assert torch.equal(ref_states[t], s_ref)
        assert rel_err(big[1, t], s_ref) <= TOL_CPU


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(k=a["k"][:, :, :-1]), "q and k"),
    (lambda a: a.update(v=a["v"][:1]), "v must be"),
    (lambda a: a.update(g=a["g"][:, :1]), "g must be"),
    (lambda a: a.update(state=a["state"].double()), "state must be float32"),
    (lambda a: a.update(out_state=a["state"][:1]), "out_state"),
    (lambda a: a.update(beta=a["beta"].long()), "beta must be a floating-point"),
    (lambda a: a.update(block_v=24), "block_v"),
    (lambda a: a.update(states=torch.zeros(1, 3, 16, 16)), "states must be float32"),
    (lambda a: a.update(states=torch.zeros(2, 3, 16, 16, dtype=torch.float64)), "states must be float32"),
])
def test_bad_input_gets_one_clear_error(change, match):
    q, k, v, g, beta, s0 = inputs(2, 3, 16, 16)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, state=s0, scale=0.25)
    change(args)
    with pytest.raises(ValueError, match=match):
        delta_rule_decode_triton(**args)


def test_rejects_sizes_beyond_the_kernel():
    with pytest.raises(ValueError, match="head sizes"):
        delta_rule_decode_triton(*inputs(1, 1, 16, 160), 0.25)
    with pytest.raises(ValueError, match="at most"):
        delta_rule_decode_triton(*inputs(gdn_decode.MAX_TOKENS + 1, 1, 16, 16), 0.25)


@pytest.mark.parametrize("T, H, dv, block_v", [(1, 5, 64, 16), (3, 3, 40, 8), (2, 1, 32, 32), (4, 3, 128, 32)])
def test_the_gated_norm_inside_the_launch_equals_the_norm_after_it(T, H, dv, block_v):
    """``norm=``: each head's last value block applies the gated RMSNorm (several blocks per head,
    one, and a head size that is not a power of two), as ``rms_norm`` does after the unnormed
    launch, operation for operation (the same bits as the norm's own Triton kernel); the gate read
    through row strides; the counters left zeroed for the next call; the state as without the norm."""
    from engine.kernels.rms_norm import rms_norm_triton
    from engine.model.norm import rms_norm_reference

    dk = 32
    q, k, v, g, beta, s0 = inputs(T, H, dk, dv, v_dtype=torch.bfloat16, seed=T + H + dv)
    wide = torch.randn(T, H * dv + 7, generator=torch.Generator().manual_seed(dv)).bfloat16()
    gate = wide[:, 3:3 + H * dv].view(T, H, dv)  # rows strided by the wider projection, as z arrives
    weight = torch.rand(dv, generator=torch.Generator().manual_seed(H)) + 0.5
    o, s = delta_rule_decode_triton(q, k, v, g, beta, s0, dk ** -0.5, block_v=block_v)
    want = rms_norm_triton(o, weight, 1e-6, gate=gate, out_dtype=torch.bfloat16)
    for _ in range(2):  # the second call finds its counters zeroed
        y, s_n = delta_rule_decode_triton(q, k, v, g, beta, s0, dk ** -0.5, block_v=block_v,
                                          norm=(gate, weight, 1e-6, torch.bfloat16))
        assert y.dtype == torch.bfloat16 and y.shape == (T, H, dv)
        assert torch.equal(y, want) and torch.equal(s_n, s)
    ref = rms_norm_reference(o, weight, 1e-6, gate=gate, out_dtype=torch.float32)
    assert rel_err(y.float(), ref) < 1e-2  # bf16 rounding of the output


def test_the_gated_norm_refuses_a_mismatched_gate_or_weight():
    q, k, v, g, beta, s0 = inputs(1, 3, 32, 32)
    gate, weight = torch.randn(1, 3, 32), torch.rand(32)
    with pytest.raises(ValueError, match="gate must be"):
        delta_rule_decode_triton(q, k, v, g, beta, s0, 1.0, norm=(gate[:, :2], weight, 1e-6, torch.float32))
    with pytest.raises(ValueError, match="weight must be"):
        delta_rule_decode_triton(q, k, v, g, beta, s0, 1.0, norm=(gate, weight[:16], 1e-6, torch.float32))


def test_availability():
    assert not gdn_decode.decode_kernel_available("cpu")
    assert not gdn_decode.decode_kernel_available("cuda", head_k=256)
    assert gdn_decode.decode_kernel_available("cuda") == torch.cuda.is_available()


REAL = dict(H=32, dk=128, dv=128)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_matches_reference_real_shape(T, v_dtype):
    q, k, v, g, beta, s0 = inputs(T, **REAL, v_dtype=v_dtype, seed=T, device="cuda")
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, s0, 128 ** -0.5)
    o, s = delta_rule_decode_triton(q, k, v, g, beta, s0, 128 ** -0.5)
    assert rel_err(o, o_ref) <= TOL_GPU and rel_err(s, s_ref) <= TOL_GPU
    state = s0.clone()
    delta_rule_decode_triton(q, k, v, g, beta, state, 128 ** -0.5, out_state=state)
    assert rel_err(state, s_ref) <= TOL_GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T, H, dk, dv", [(5, 4, 64, 64), (16, 4, 64, 64), (5, 32, 128, 128)])
def test_per_token_states_on_cuda(T, H, dk, dv):
    """The per-token states compiled: the shipped target's GDN heads at verify blocks of 5 and 16, and the
    35B's; each row against the definition after that many tokens, the output and new state unchanged."""
    q, k, v, g, beta, s0 = inputs(T, H, dk, dv, seed=30 + T, device="cuda")
    states = torch.full((T, H, dk, dv), float("nan"), device="cuda")
    o_plain, s_plain = delta_rule_decode_triton(q, k, v, g, beta, s0, dk ** -0.5)
    o, s = delta_rule_decode_triton(q, k, v, g, beta, s0, dk ** -0.5, states=states)
    assert torch.equal(o, o_plain) and torch.equal(s, s_plain) and torch.equal(states[-1], s)
    ref = torch.empty_like(states)
    delta_rule_recurrent(q, k, v, g, beta, s0, dk ** -0.5, states=ref)
    assert all(rel_err(states[t], ref[t]) <= TOL_GPU for t in range(T))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 16])
def test_the_gated_norm_inside_the_launch_real_shape(T):
    """The 35B shape compiled: the normed launch against the norm's own kernel after the plain one
    (within one bf16 rounding: the two reductions may differ in order on the GPU)."""
    from engine.kernels.rms_norm import rms_norm_triton

    q, k, v, g, beta, s0 = inputs(T, **REAL, v_dtype=torch.bfloat16, seed=20 + T, device="cuda")
    gate = torch.randn(T, 32, 128, device="cuda").bfloat16()
    weight = torch.rand(128, device="cuda") + 0.5
    o, s = delta_rule_decode_triton(q, k, v, g, beta, s0, 128 ** -0.5)
    want = rms_norm_triton(o, weight, 1e-6, gate=gate, out_dtype=torch.bfloat16)
    for _ in range(2):
        y, s_n = delta_rule_decode_triton(q, k, v, g, beta, s0, 128 ** -0.5, norm=(gate, weight, 1e-6, torch.bfloat16))
        assert torch.allclose(y.float(), want.float(), rtol=8e-3, atol=1e-5) and torch.equal(s_n, s)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("v_dtype, tol", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 4])
def test_agrees_with_fla_fused_recurrent(T, v_dtype, tol):
    pytest.importorskip("fla")
    rule = DeltaRule.select("cuda")
    assert rule.backend == "fla"
    q, k, v, g, beta, s0 = inputs(T, **REAL, v_dtype=v_dtype, seed=10 + T, device="cuda")
    o_fla, s_fla = rule.recurrent(q, k, v, g, beta, s0, 128 ** -0.5)
    o, s = delta_rule_decode_triton(q, k, v, g, beta, s0, 128 ** -0.5)
    assert rel_err(o, o_fla.float()) <= tol and rel_err(s, s_fla.float()) <= tol
