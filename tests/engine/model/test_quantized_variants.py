"""Q8_0 and Q4_K versions of one model against its F32 version.

A random HF model whose every matrix row is a multiple of 256 (so Q4_K really applies) is
converted to F32, then re-quantized tensor by tensor. Random models amplify weight errors
strongly (measured, seed 0, 40 tokens: Q8_0 moves the logits by ~5% and Q4_K by ~58%, from
per-tensor weight errors of ~0.5% and ~8%; noise twins: 5.1% and 61%), so the logit bound is against a "noise
twin": the F32 model with Gaussian noise of exactly the quantization error's norm added to
each quantized tensor. The quantized file must stay within 2x of the twin's logit error;
and it must compute exactly what the F32 file holding its dequantized weights computes.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.gguf.convert_hf import convert_hf
from engine.gguf.reader import GGUFFile
from engine.gguf.writer import TensorSpec, write_gguf
from engine.model.qwen35moe import Qwen35MoE
from engine.sampling import SamplingParams, sample

WIDE = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
            moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=8,
            num_experts_per_tok=8, vocab_size=300, num_hidden_layers=4, initializer_range=0.02)

BOUNDS = {Q.Q8_0: 0.012, Q.Q4_K: 0.10}  # per-tensor relative weight error (measured 0.005, 0.08)


def _is_matrix(name: str, shape) -> bool:
    return len(shape) >= 2 and "norm" not in name and "ffn_gate_inp" not in name and "ssm_conv1d" not in name


def rewrite(src, dst, qtype_of, values_of):
    """Copy ``src`` to ``dst`` with each tensor's type and values chosen per tensor."""
    with GGUFFile(src) as f:
        specs = [TensorSpec(name, info.shape, qtype_of(name, info.shape),
                            lambda name=name: values_of(f, name).numpy().astype(np.float32))
                 for name, info in f.tensors.items()]
        write_gguf(dst, dict(f.metadata), specs)
    return dst


@pytest.fixture(scope="module")
def variants(hf_model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    f32 = convert_hf(hf_model_factory(seed=0, **WIDE), root / "wide-f32.gguf")
    out = {Q.F32: f32}
    for q in BOUNDS:
        out[q] = rewrite(f32, root / f"wide-{q.name}.gguf",
                         lambda n, s, q=q: q if _is_matrix(n, s) else Q.F32, lambda f, n: f.load(n))
        with GGUFFile(out[q]) as quant:
            # the F32 file holding exactly the dequantized weights
            out[(q, "dequantized")] = rewrite(out[q], root / f"wide-{q.name}-deq.gguf",
                                              lambda n, s: Q.F32, lambda f, n: f.load(n))
            gen = torch.Generator().manual_seed(5)

            def twin(f, n, quant=quant, gen=gen):
                w = f.load(n)
                if not _is_matrix(n, w.shape):
                    return w
                err = (quant.load(n) - w).norm()
                noise = torch.randn(w.shape, generator=gen)
                return w + noise * (err / noise.norm())

            out[(q, "twin")] = rewrite(f32, root / f"wide-{q.name}-twin.gguf", lambda n, s: Q.F32, twin)
    return out


def load(path):
    with GGUFFile(path) as f:
        return Qwen35MoE.from_gguf(f, device="cpu", dtype=torch.float32), {i.qtype for i in f.tensors.values()}


def run(model, ids):
    return model.forward(torch.tensor(ids), model.new_state(len(ids) + 16), logits="all").logits


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("qtype", list(BOUNDS))
def test_quantized_weights_within_bound(variants, qtype):
    with GGUFFile(variants[Q.F32]) as ref, GGUFFile(variants[qtype]) as got:
        errors = {n: rel(got.load(n), ref.load(n)) for n, i in ref.tensors.items() if _is_matrix(n, i.shape)}
        assert {got.tensors[n].qtype for n in errors} == {qtype}  # every matrix really is stored so
    worst = max(errors, key=errors.get)
    assert 0 < errors[worst] <= BOUNDS[qtype], f"{worst}: relative error {errors[worst]:.4f}"


@pytest.mark.parametrize("qtype", list(BOUNDS))
def test_quantized_logits_stay_within_quantization_error(variants, qtype):
    ids = torch.randint(0, WIDE["vocab_size"], (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = run(load(variants[Q.F32])[0], ids)
    got = run(load(variants[qtype])[0], ids)
    assert torch.isfinite(got).all()
    # the quantized path computes the same function as plain F32 weights of the same values
    same = run(load(variants[(qtype, "dequantized")])[0], ids)
    assert rel(got, same) <= 1e-5
    # and moves the logits no more than noise of the quantization error's size does
    twin = rel(run(load(variants[(qtype, "twin")])[0], ids), ref)
    err = rel(got, ref)
    assert 0 < err <= 2 * twin, f"{qtype.name}: logit error {err:.4f}, noise twin {twin:.4f}"


@pytest.mark.parametrize("qtype", list(BOUNDS))
def test_quantized_models_generate_without_nan(variants, qtype):
    model, _ = load(variants[qtype])
    state = model.new_state(64)
    logits = model.forward(torch.tensor([1, 2, 3]), state, logits="last").logits[-1]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(24):
        assert torch.isfinite(logits).all()
        tok = sample(logits, params, gen)
        logits = model.forward(tok.reshape(1), state, logits="last").logits[-1]
