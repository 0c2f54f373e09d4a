"""The one-launch RMSNorm kernel against the torch definition: odd widths, strided rows (query
and key heads are slices of a wider projection), the SiLU gate of Gated DeltaNet's output norm,
output dtypes; on the CPU through the Triton interpreter, on CUDA through the engine's dispatch."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated

from engine.model.norm import rms_norm, rms_norm_reference  # noqa: E402

kernels = pytest.importorskip("engine.kernels.rms_norm")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# bf16 outputs: one bf16 step (2**-7 of the value at most) apart, since the two sides round from
# floats that differ in their last bits, and the interpreter converts to bf16 by truncation
BF16_TOL = 2 ** -7


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def case(shape, seed, dtype=torch.float32, wide=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape[:-1], shape[-1] * (2 if wide else 1), generator=g) * 3
    if wide:  # rows strided like q = qg[..., :D]
        x = x[..., :shape[-1]]
    w = torch.rand(shape[-1], generator=g) + 0.5
    return x.to(DEVICE, dtype), w.to(DEVICE)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 130), (2, 3, 64), (4, 6, 33)])
@pytest.mark.parametrize("wide", [False, True])
def test_matches_reference(shape, wide):
    x, w = case(shape, seed=sum(shape), wide=wide)
    out = kernels.rms_norm_triton(x, w, 1e-6)
    assert out.shape == x.shape and out.is_contiguous() and out.dtype == x.dtype
    assert rel_err(out, rms_norm_reference(x, w, 1e-6)) < 1e-6


@pytest.mark.parametrize("shape", [(3, 4, 64), (2, 5, 19)])
def test_gate_and_out_dtype(shape):
    """Gated DeltaNet's output norm: float32 in, ``silu(z)`` gate, the layer's dtype out."""
    x, w = case(shape, seed=11)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.bfloat16)
    out = kernels.rms_norm_triton(x, w, 1e-6, gate=z, out_dtype=torch.bfloat16)
    ref = rms_norm_reference(x, w, 1e-6, gate=z, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float(), ref.float()) < BF16_TOL


def test_bf16_input():
    x, w = case((4, 96), seed=3, dtype=torch.bfloat16)
    out = kernels.rms_norm_triton(x, w, 1e-6)
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), rms_norm_reference(x, w, 1e-6).float()) < BF16_TOL


def test_bad_inputs():
    x, w = case((3, 8), seed=1)
    with pytest.raises(ValueError, match="weight must be"):
        kernels.rms_norm_triton(x, w[:5], 1e-6)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        kernels.rms_norm_triton(x.t(), w[:3], 1e-6)
    with pytest.raises(ValueError, match="gate must have"):
        kernels.rms_norm_triton(x, w, 1e-6, gate=x[:2])


def test_dispatch_keeps_autograd_on_the_reference():
    """Training needs gradients: with a parameter that requires them the torch path runs."""
    x, w = case((3, 16), seed=5)
    w = w.clone().requires_grad_(True)
    out = rms_norm(x, w, 1e-6)
    out.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(1, 2048), (7, 2048), (1, 32, 128), (16, 16, 256)])
def test_cuda_dispatch_matches_reference(shape):
    x, w = case(shape, seed=2, dtype=torch.bfloat16, wide=len(shape) == 3)
    with torch.inference_mode():
        out = rms_norm(x, w, 1e-6)
    assert rel_err(out.float(), rms_norm_reference(x, w, 1e-6).float()) < BF16_TOL


def test_l2norm_is_an_rms_norm_with_a_scaled_weight():
    """What ``l2norm`` runs on CUDA: weight 1/sqrt(D), epsilon eps/D, through the kernel."""
    from engine.model.gated_deltanet import l2norm

    x, _ = case((3, 4, 64), seed=8, wide=True)
    w = torch.full((64,), 64 ** -0.5, device=DEVICE)
    out = kernels.rms_norm_triton(x, w, 1e-6 / 64, out_dtype=torch.float32)
    assert rel_err(out, l2norm(x.cpu()).to(DEVICE)) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_l2norm_matches_the_definition():
    from engine.model.gated_deltanet import l2norm

    x = torch.randn(5, 16, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        out = l2norm(x.cuda())
    assert out.dtype == torch.float32 and rel_err(out.cpu(), l2norm(x)) < 1e-6


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 130), (2, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_add_then_norm(shape, dtype):
    """The residual add before a layer's norm: ``h + r`` rounded to h's dtype, then its norm."""
    h, w = case(shape, seed=sum(shape), dtype=dtype)
    r = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2).to(DEVICE, dtype)
    h_new, out = kernels.add_rms_norm_triton(h, r, w, 1e-6)
    ref_h = h + r
    # exact, except that the interpreter rounds to bf16 by truncation: one bf16 step there
    step = 2 ** -7 if dtype == torch.bfloat16 and DEVICE == "cpu" else 0.0
    torch.testing.assert_close(h_new, ref_h, rtol=step, atol=0)
    ref = rms_norm_reference(h_new, w, 1e-6)  # the norm of the stored sum
    assert out.dtype == dtype
    assert rel_err(out.float(), ref.float()) < (BF16_TOL if dtype == torch.bfloat16 else 1e-6)
    with pytest.raises(ValueError, match="one \\[A, D\\] shape"):
        kernels.add_rms_norm_triton(h, r[:0], w, 1e-6)


def test_add_rms_norm_dispatch_without_residual_and_under_autograd():
    from engine.model.norm import add_rms_norm

    h, w = case((3, 16), seed=2)
    same, out = add_rms_norm(h, None, w, 1e-6)
    assert same is h and rel_err(out, rms_norm_reference(h, w, 1e-6)) < 1e-6
    r = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    h_new, out = add_rms_norm(h, r, w, 1e-6)  # a tensor that needs gradients: the torch path
    out.sum().backward()
    assert r.grad is not None and rel_err(h_new.detach(), h + r.detach()) == 0


def test_model_logits_with_the_fused_residual_norms(tmp_path, monkeypatch):
    """Every layer's two residual adds and the final one through the kernel, hidden captures too."""
    from engine.gguf.make_model import make_model
    from engine.gguf.reader import GGUFFile
    from engine.model import norm
    from engine.model.qwen35moe import Qwen35MoE

    with GGUFFile(make_model(tmp_path / "tiny.gguf", "tiny", seed=4)) as f:
        model = Qwen35MoE.from_gguf(f, device=DEVICE, dtype=torch.float32)
    ids = torch.arange(12, device=DEVICE) * 29 % model.cfg.vocab
    last = model.cfg.n_layers - 1
    outs = []
    for fused in (False, True):
        monkeypatch.setattr(norm, "FUSED_ADD_NORM", fused)
        outs.append(model.forward(ids, model.new_state(16), capture_layers={0, last}, logits="all"))
    ref, out = outs
    assert set(out.hidden) == {0, last}
    assert rel_err(out.logits, ref.logits) < 1e-5
    for i in (0, last):
        assert rel_err(out.hidden[i], ref.hidden[i]) < 1e-5
