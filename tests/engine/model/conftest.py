"""A random tiny transformers Qwen3_5MoeForCausalLM and its GGUF conversion, shared by the tests.

Value heads (4) differ from key heads (2), so the GGUF value-head tiling matters; 8 layers
give 6 Gated DeltaNet and 2 attention layers; norms, A_log and dt_bias are moved away from
their initial values so that a wrong norm convention or a missed transform shows.
"""

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

HF_CONFIG = dict(
    vocab_size=101, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=24, shared_expert_intermediate_size=40,
    num_experts=8, num_experts_per_tok=3, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.08,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1]},
)


def _hf_model_class():
    """transformers binds fla's Triton kernels into the model at import when fla is installed,
    and those cannot run on the CPU, where the reference runs: import it with fla hidden."""
    hidden = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "fla"}
    sys.modules["fla"] = None  # makes "import fla" fail
    try:
        return transformers.Qwen3_5MoeForCausalLM
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)


def make_hf_model(seed: int = 0, **overrides) -> "transformers.Qwen3_5MoeForCausalLM":
    torch.manual_seed(seed)
    cfg = transformers.Qwen3_5MoeTextConfig(**{**HF_CONFIG, **overrides})
    model = _hf_model_class()(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(0.7 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn_like(p))
    return model


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Every model test runs on one thread (``one_thread`` in tests/engine/conftest.py)."""


@pytest.fixture(scope="session")
def hf_model():
    return make_hf_model()


@pytest.fixture(scope="session")
def hf_model_factory():
    """``make_hf_model`` for tests that need another variant (seed or config overrides)."""
    return make_hf_model


@pytest.fixture(scope="session")
def gguf_path(hf_model, tmp_path_factory):
    from engine.gguf.convert_hf import convert_hf

    return convert_hf(hf_model, tmp_path_factory.mktemp("oracle") / "tiny-hf.gguf")


@pytest.fixture(scope="session")
def engine_model(gguf_path):
    from engine.gguf.reader import GGUFFile
    from engine.model.qwen35moe import Qwen35MoE

    with GGUFFile(gguf_path) as f:
        return Qwen35MoE.from_gguf(f, device="cpu")


@pytest.fixture(scope="session")
def hf_logits(hf_model):
    """transformers' float32 logits [T, vocab] for ids [T], no cache."""

    def run(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return hf_model(ids[None], use_cache=False).logits[0].float()

    return run
