"""Shared by the fused kernels' model-level tests. Engine modules are imported inside the
fixtures: a test module sets TRITON_INTERPRET before the kernels are decorated."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def tiny_float32_model(tmp_path_factory):
    from engine.gguf.make_model import make_model
    from engine.gguf.reader import GGUFFile
    from engine.model.qwen35moe import Qwen35MoE

    with GGUFFile(make_model(tmp_path_factory.mktemp("fused") / "tiny.gguf", "tiny", seed=5)) as f:
        return Qwen35MoE.from_gguf(f, device=DEVICE, dtype=torch.float32)


@pytest.fixture
def fused_against_reference(monkeypatch):
    """``run(model, module, flag, prefill, T)``: prefill ``prefill`` tokens on the reference path,
    then forward ``T`` more with ``module.flag`` False and True. Returns [(logits, state) of the
    reference path, (logits, state) of the fused path]."""

    def run(model, module, flag, prefill, T):
        ids = torch.arange(prefill + T, device=DEVICE) * 37 % model.cfg.vocab
        runs = []
        for fused in (False, True):
            monkeypatch.setattr(module, flag, False)
            state = model.new_state(prefill + T + 8)
            model.forward(ids[:prefill], state, logits="none")
            monkeypatch.setattr(module, flag, fused)
            runs.append((model.forward(ids[prefill:], state, logits="all").logits, state))
        monkeypatch.setattr(module, flag, None)
        return runs

    return run
