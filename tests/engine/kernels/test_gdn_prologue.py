"""The fused Gated DeltaNet prologue (conv, SiLU, L2 norms, head spread, gates) against its torch
definition: odd head counts and sizes, 1 to 16 tokens, conv states that the block fills only
partly, outputs written into given buffers with the rollback's conv window; then a whole GDN
layer and a model's logits with the fused path against the reference path. On the CPU through
the Triton interpreter, on CUDA compiled."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated

from engine.model import gated_deltanet as gdn  # noqa: E402

kernels = pytest.importorskip("engine.kernels.gdn_prologue")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass(frozen=True)
class Shape:
    hk: int
    hv: int
    dk: int
    dv: int
    K: int = 4

    @property
    def C(self):
        return 2 * self.hk * self.dk + self.hv * self.dv


class Cfg:  # the fields gdn_prologue_reference reads
    def __init__(self, s: Shape):
        self.gdn_k_heads, self.gdn_v_heads, self.gdn_head_k, self.gdn_head_v = s.hk, s.hv, s.dk, s.dv
        self.gdn_key_dim, self.gdn_value_dim = s.hk * s.dk, s.hv * s.dv


def inputs(s: Shape, T: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, s.C, generator=g) * 2
    state = torch.randn(s.C, s.K - 1, generator=g)
    w = torch.randn(s.C, s.K, generator=g) * 0.5
    b, alpha = torch.randn(T, s.hv, generator=g) * 3, torch.randn(T, s.hv, generator=g) * 8
    a = -torch.rand(s.hv, generator=g) * 4
    dt = torch.randn(s.hv, generator=g)
    alpha[0, 0] = 30.0  # softplus's linear branch
    return [x.to(DEVICE, dtype) for x in (qkv, state, w, b, alpha)] + [a.to(DEVICE), dt.to(DEVICE)]


SHAPES = [Shape(1, 1, 8, 8), Shape(2, 4, 16, 24), Shape(3, 6, 33, 17), Shape(2, 2, 128, 128),
          Shape(4, 8, 20, 12, K=3)]


@pytest.mark.parametrize("s", SHAPES, ids=str)
@pytest.mark.parametrize("T", [1, 2, 5, 16])
def test_matches_the_torch_definition(s, T):
    qkv, state, w, b, alpha, a, dt = inputs(s, T, seed=T + s.C)
    ref_state = state.clone()
    ref = gdn.gdn_prologue_reference(qkv, ref_state, w, b, alpha, a, dt, Cfg(s))
    out = kernels.gdn_prologue_triton(qkv, state, w, b, alpha, a, dt, k_heads=s.hk, v_heads=s.hv,
                                      head_k=s.dk, head_v=s.dv)
    for name, x, r in zip(("q", "k", "v", "g", "beta"), out, ref):
        assert x.shape == r.shape and x.dtype == r.dtype, name
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)  # the conv state: copied values


def test_writes_into_given_buffers_and_the_rollback_window():
    s, T = Shape(2, 4, 16, 24), 5
    qkv, state, w, b, alpha, a, dt = inputs(s, T, seed=1)
    old = state.clone()
    ref = gdn.gdn_prologue_reference(qkv, old.clone(), w, b, alpha, a, dt, Cfg(s))
    f32 = dict(device=DEVICE, dtype=torch.float32)
    out = (torch.zeros(T, s.hv, s.dk, **f32), torch.zeros(T, s.hv, s.dk, **f32),
           torch.zeros(T, s.hv, s.dv, **f32), torch.zeros(T, s.hv, **f32), torch.zeros(T, s.hv, **f32))
    window = torch.zeros(s.C, s.K - 1 + T, **f32)
    got = kernels.gdn_prologue_triton(qkv, state, w, b, alpha, a, dt, k_heads=s.hk, v_heads=s.hv,
                                      head_k=s.dk, head_v=s.dv, out=out, window=window)
    assert all(x is o for x, o in zip(got, out))
    for x, r in zip(out, ref):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(window, torch.cat([old, qkv.T], dim=1), rtol=0, atol=0)


def test_bf16_inputs_round_only_at_the_end():
    s, T = Shape(2, 4, 32, 32), 3
    qkv, state, w, b, alpha, a, dt = inputs(s, T, seed=7, dtype=torch.bfloat16)
    ref = gdn.gdn_prologue_reference(*(x.float() for x in (qkv, state.clone(), w, b, alpha)), a, dt, Cfg(s))
    out = kernels.gdn_prologue_triton(qkv, state, w, b, alpha, a, dt, k_heads=s.hk, v_heads=s.hv,
                                      head_k=s.dk, head_v=s.dv)
    assert out[2].dtype == torch.bfloat16 and out[0].dtype == torch.float32
    for x, r in zip(out, ref):  # computed from the same bf16 inputs in float32: v rounded once
        torch.testing.assert_close(x.float(), r, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(T=17), "1 to 16 tokens"),
    (dict(hv=3), "multiple of key heads"),
    (dict(bad_state=True), "do not fit"),
])
def test_bad_shapes_are_refused(kwargs, message):
    s = Shape(2, kwargs.get("hv", 4), 8, 8)
    T = kwargs.get("T", 2)
    qkv, state, w, b, alpha, a, dt = inputs(Shape(2, 4, 8, 8), T, seed=0)
    if kwargs.get("bad_state"):
        state = state[:, :1]
    if "hv" in kwargs:  # a C consistent with 3 value heads, so the head check is the one that fires
        qkv = torch.randn(T, s.C, device=DEVICE)
        w, state = torch.randn(s.C, 4, device=DEVICE), torch.randn(s.C, 3, device=DEVICE)
        b, alpha = torch.randn(T, 3, device=DEVICE), torch.randn(T, 3, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        kernels.gdn_prologue_triton(qkv, state, w, b, alpha, a, dt, k_heads=s.hk, v_heads=s.hv,
                                    head_k=s.dk, head_v=s.dv)


@pytest.mark.parametrize("T", [1, 4, 16])
def test_model_logits_and_states_with_the_fused_prologue(tiny_float32_model, fused_against_reference, T):
    """Prefill 24 tokens on the reference path, then T tokens with and without the fused path."""
    (ref, ref_state), (out, state) = fused_against_reference(tiny_float32_model, gdn, "FUSED_PROLOGUE", 24, T)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    first = min(ref_state.conv)  # its inputs are the same on both paths: copied values agree exactly
    torch.testing.assert_close(state.conv[first], ref_state.conv[first], rtol=0, atol=0)
    for i in ref_state.conv:  # later layers' inputs carry the earlier layers' rounding differences
        torch.testing.assert_close(state.conv[i], ref_state.conv[i], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.recurrent[i], ref_state.recurrent[i], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4, 16])
def test_real_shapes_on_cuda(dtype, T):
    """Qwen3.6-35B-A3B's Gated DeltaNet: 16 key heads, 32 value heads of 128, conv kernel 4."""
    s = Shape(16, 32, 128, 128)
    qkv, state, w, b, alpha, a, dt = inputs(s, T, seed=T, dtype=dtype)
    ref = gdn.gdn_prologue_reference(*(x.float() for x in (qkv, state.clone(), w, b, alpha)), a, dt, Cfg(s))
    out = kernels.gdn_prologue_triton(qkv, state, w, b, alpha, a, dt, k_heads=16, v_heads=32, head_k=128, head_v=128)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    for x, r in zip(out, ref):
        torch.testing.assert_close(x.float(), r, rtol=tol, atol=1e-3 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dispatch_takes_the_fused_prologue(tiny_float32_model, monkeypatch):
    """On CUDA a short call takes the kernel by itself (FUSED_PROLOGUE None), with the same logits."""
    calls = []
    real = gdn._prologue_kernel()
    monkeypatch.setattr(gdn, "_prologue_kernel", lambda: (lambda *a, **k: calls.append(1) or real(*a, **k)))
    model = tiny_float32_model
    ids = torch.arange(20, device=DEVICE) * 11 % model.cfg.vocab
    outs = []
    for fused in (False, None):
        monkeypatch.setattr(gdn, "FUSED_PROLOGUE", fused)
        state = model.new_state(32)
        model.forward(ids[:16], state, logits="none")
        outs.append(model.forward(ids[16:], state, logits="all").logits)
    assert calls  # the second run's short calls went through the kernel
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
