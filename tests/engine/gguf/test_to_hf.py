"""to_hf: a qwen35moe GGUF loaded into transformers' module gives the engine's logits, and
HF -> GGUF -> HF gives back the tensors it started from.

Error bound on the CPU (float32), the engine's oracle bound: max |HF - engine| <= 1e-3 *
max |engine| over every logit, and the same argmax at every position. Measured: 3e-6 on the
shipped target over 200 tokens; 4e-5 to 1e-4 on random tiny files over 150 tokens, the error
growing along the sequence (the two Gated DeltaNet chunk algorithms round differently).
"""

from pathlib import Path

import pytest
import torch

from engine.errors import ConfigError
from engine.gguf.convert_hf import convert_hf
from engine.gguf.make_model import make_model
from engine.gguf.reader import GGUFFile
from engine.gguf.to_hf import hf_config, hf_model_from_gguf, hf_state_dict
from engine.model.config import ModelConfig
from engine.model.qwen35moe import Qwen35MoE
from engine.train.family import MICRO
from engine.train.train_target import hf_model_class

pytest.importorskip("transformers")

REL_TOL = 1e-3
SHIPPED_TARGET = Path(__file__).resolve().parents[3] / "models" / "luce-target.gguf"


pytestmark = pytest.mark.usefixtures("one_thread")


def _logits_both(path: Path, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    hf = hf_model_from_gguf(path)
    with GGUFFile(path) as f:
        engine = Qwen35MoE.from_gguf(f, device="cpu", force_torch_gdn=True)
    ids = torch.randint(0, engine.cfg.vocab, (length,), generator=torch.Generator().manual_seed(seed))
    ref = engine.forward(ids, engine.new_state(length)).logits
    with torch.no_grad():
        out = hf(ids[None], use_cache=False).logits[0].float()
    return out, ref


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err <= REL_TOL, f"relative error {err:.2e} over {REL_TOL:.0e}"
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("quant, fused", [("f32", False), ("q8_0", True)])
def test_random_gguf_gives_the_engines_logits(tmp_path, quant, fused):
    path = make_model(tmp_path / "m.gguf", "tiny", seed=5, quant=quant, fused_experts=fused)
    _check(*_logits_both(path, 150, seed=1))


@pytest.mark.skipif(not SHIPPED_TARGET.is_file(), reason="models/luce-target.gguf not present")
def test_shipped_target_gives_the_engines_logits():
    _check(*_logits_both(SHIPPED_TARGET, 200, seed=2))


def _random_hf_model(*, tied: bool = False):
    config = MICRO.hf_config(97)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = hf_model_class(False)[0](config).float().eval()
    with torch.no_grad():  # move every vector away from its initial value, so a missed transform shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn_like(p))
    return model


def test_hf_to_gguf_to_hf_round_trip(tmp_path):
    model = _random_hf_model()
    path = convert_hf(model, tmp_path / "rt.gguf")
    with GGUFFile(path) as f:
        sd = hf_state_dict(f, ModelConfig.from_metadata(f.metadata))
    ref = model.state_dict()
    assert sd.keys() == ref.keys()
    for name, t in ref.items():
        if name.endswith(("norm.weight", "A_log")) and not name.endswith("linear_attn.norm.weight"):
            # (1 + w) - 1 and log(exp(A_log)) in float32: a few ulps of 1
            torch.testing.assert_close(sd[name], t, rtol=1e-6, atol=2e-7, msg=name)
        else:
            assert torch.equal(sd[name], t), name

    loaded = hf_model_from_gguf(path)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_a_file_without_output_weight_gives_tied_embeddings(tmp_path):
    model = _random_hf_model(tied=True)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = convert_hf(sd, tmp_path / "tied.gguf", config=model.config)
    with GGUFFile(path) as f:
        assert "output.weight" not in f.tensors
    loaded = hf_model_from_gguf(path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_config_is_the_inverse_of_config_from_hf():
    from engine.gguf.convert_hf import config_from_hf, hf_text_config

    cfg = MICRO.model_config(97)
    assert config_from_hf(hf_text_config(hf_config(cfg))) == cfg
    with pytest.raises(ConfigError, match="no shared expert"):
        hf_config(ModelConfig(**{**cfg.__dict__, "shared_ffn": 0}))
