"""Projection matrices kept as GGUF blocks: the same forward pass as the dequantized weights."""

from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.errors import ConfigError
from engine.gguf.make_model import make_model
from engine.gguf.reader import GGUFFile
from engine.kernels.quant import QuantMatrix
from engine.model.qwen35moe import Qwen35MoE

SHIPPED = Path(__file__).resolve().parents[3] / "models" / "luce-target.gguf"


def _load(path, quantized, device="cpu", dtype=torch.float32):
    with GGUFFile(path) as f:
        return Qwen35MoE.from_gguf(f, device=device, dtype=dtype, quantized=quantized)


def _logits(model, ids):
    return model.forward(torch.tensor(ids), model.new_state(len(ids) + 1), logits="all").logits


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_quantized_projections_give_the_dense_logits(tmp_path, quant):
    path = make_model(tmp_path / f"{quant}.gguf", "tiny", quant=quant, seed=5)
    dense, kept = _load(path, False), _load(path, True)
    layer = next(i for i in range(kept.cfg.n_layers) if not kept.cfg.is_attention(i))
    attn = next(i for i in range(kept.cfg.n_layers) if kept.cfg.is_attention(i))
    assert isinstance(kept.weights.layers[layer].mixer.qkv, QuantMatrix)
    assert isinstance(kept.weights.layers[attn].mixer.q, QuantMatrix)
    assert not isinstance(dense.weights.layers[layer].mixer.qkv, QuantMatrix)
    ids = [3, 17, 42, 99, 7, 250, 1, 64, 31]
    ref, got = _logits(dense, ids), _logits(kept, ids)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_value_head_reorder_of_quantized_gdn_matrices(tmp_path):
    """Every GDN matrix, value-head order included, dequantizes to the dense loader's tensor."""
    path = make_model(tmp_path / "q8.gguf", "tiny", quant="q8_0", seed=2)
    dense, kept = _load(path, False), _load(path, True)
    assert dense.cfg.gdn_k_heads != dense.cfg.gdn_v_heads  # the reorder is exercised
    checked = 0
    for d, q in zip(dense.weights.layers, kept.weights.layers):
        for name in ("qkv", "z", "beta", "alpha", "out", "q", "k", "v", "o"):
            w = getattr(q.mixer, name, None)
            if isinstance(w, QuantMatrix):
                torch.testing.assert_close(w.dequantize(torch.float32), getattr(d.mixer, name), atol=0, rtol=0)
                checked += 1
    assert checked >= 9


def test_float_files_stay_dense(tmp_path):
    path = make_model(tmp_path / "f32.gguf", "tiny", quant="f32", seed=1)
    model = _load(path, True)
    assert not any(isinstance(getattr(layer.mixer, n, None), QuantMatrix)
                   for layer in model.weights.layers for n in ("q", "qkv"))


def test_greedy_output_on_the_trained_model_equals_dense():
    dense = Engine.from_gguf(SHIPPED, device="cpu")
    kept = Engine.from_gguf(SHIPPED, device="cpu", weights="quantized")
    ids = dense.tokenizer.encode("def parse_args(argv):\n    ")
    assert kept.generate(ids, 24, ignore_eos=True).ids == dense.generate(ids, 24, ignore_eos=True).ids


def test_bad_weights_option_is_refused(tmp_path):
    path = make_model(tmp_path / "m.gguf", "tiny", seed=0)
    with pytest.raises(ConfigError, match="weights must be"):
        Engine.from_gguf(path, device="cpu", weights="int3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_quantized_path_greedy_equals_dense_on_cuda():
    dense = Engine.from_gguf(SHIPPED, device="cuda", dtype="float32")
    kept = Engine.from_gguf(SHIPPED, device="cuda", dtype="float32", weights="quantized")
    ids = dense.tokenizer.encode("import os\n\ndef walk(root):\n    ")
    assert kept.generate(ids, 32, ignore_eos=True).ids == dense.generate(ids, 32, ignore_eos=True).ids
