"""A fused decode kernel that fails to build is switched off with one warning and its calls take
the torch path; LUCE_TUNE_FUSED_KERNELS=0 switches them all off; a forced kernel lets errors through."""

import pytest
import torch

from engine.gguf.make_model import make_model
from engine.gguf.reader import GGUFFile
from engine.kernels import fused
from engine.model import gated_deltanet as gdn
from engine.model import attention, moe, norm
from engine.model.qwen35moe import Qwen35MoE


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    with GGUFFile(make_model(tmp_path_factory.mktemp("fallback") / "tiny.gguf", "tiny", seed=6)) as f:
        return Qwen35MoE.from_gguf(f, device="cpu", dtype=torch.float32)


def broken(*args, **kwargs):
    raise RuntimeError("no kernel image for this device")


def logits(model):
    ids = torch.arange(6) * 41 % model.cfg.vocab
    return model.forward(ids, model.new_state(8), logits="all").logits


def test_a_kernel_that_fails_is_switched_off_once_and_the_torch_path_answers(model, monkeypatch):
    monkeypatch.setattr(fused, "_failed", {})
    ref = logits(model)
    # every dispatcher picks its kernel by itself (as on CUDA), and every kernel fails to build
    monkeypatch.setattr(gdn, "_fused_prologue", lambda *a: True)
    monkeypatch.setattr(gdn, "_prologue_kernel", lambda: broken)
    monkeypatch.setattr(moe, "_fused_gate", lambda *a: True)
    import engine.kernels.moe_gate as gate_kernels
    import engine.kernels.rms_norm as norm_kernels

    monkeypatch.setattr(gate_kernels, "route_triton", broken)
    monkeypatch.setattr(gate_kernels, "add_norm_route_triton", broken)  # moe.NORM_IN_ROUTER is on
    monkeypatch.setattr(gate_kernels, "swiglu_triton", broken)
    monkeypatch.setattr(norm, "FUSED_ADD_NORM", None)
    monkeypatch.setattr(norm, "_picks_kernel", lambda h: fused.allowed(norm.ADD_NORM))  # as on CUDA
    monkeypatch.setattr(norm_kernels, "add_rms_norm_triton", broken)
    import engine.kernels.rope_norm as rope_kernels

    monkeypatch.setattr(attention, "_picks_kernel", lambda x: fused.allowed(attention.NORM_ROPE))
    monkeypatch.setattr(rope_kernels, "norm_rope_triton", broken)
    with pytest.warns(RuntimeWarning, match="failed on this machine") as caught:
        out = logits(model)
        again = logits(model)
    assert set(fused.failures()) == {gdn.PROLOGUE, moe.GATE, norm.ADD_NORM, attention.NORM_ROPE}
    monkeypatch.undo()
    assert len(caught) == 4  # one warning per kernel family, not per call
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)


def test_the_environment_switches_them_off_and_forced_kernels_raise(monkeypatch):
    monkeypatch.setattr(fused, "_failed", {})
    assert fused.allowed(gdn.PROLOGUE)
    monkeypatch.setenv(fused.ENV, "0")
    assert not any(fused.allowed(n) for n in (gdn.PROLOGUE, moe.GATE, norm.ADD_NORM, attention.NORM_ROPE))
    monkeypatch.delenv(fused.ENV)
    monkeypatch.setattr(norm, "FUSED_ADD_NORM", True)
    import engine.kernels.rms_norm as norm_kernels

    monkeypatch.setattr(norm_kernels, "add_rms_norm_triton", broken)
    h = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="no kernel image"):
        norm.add_rms_norm(h, h, torch.ones(8), 1e-6)
    assert fused.failures() == {}


def test_generation_timings_name_the_kernels_switched_off(tmp_path, monkeypatch):
    from engine.engine import Engine

    path = make_model(tmp_path / "tiny.gguf", "tiny", seed=6)
    eng = Engine.from_gguf(path, device="cpu")
    monkeypatch.setattr(fused, "_failed", {})
    assert "fused_kernels_off" not in eng.generate([1, 2, 3], 3, ignore_eos=True).timings.extra
    with pytest.warns(RuntimeWarning):
        fused.switch_off(moe.GATE, RuntimeError("no kernel image"))
    assert eng.generate([1, 2, 3], 3, ignore_eos=True).timings.extra["fused_kernels_off"] == moe.GATE
