"""make_model: tiny files read back with the right tensors, types, tokenizer and weight scales."""

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, TokenType
from rich.console import Console

from engine.errors import ConfigError
from engine.gguf import quants
from engine.gguf.inspect import render, summarize
from engine.gguf.make_model import TINY_ORDINARY_TOKENS, default_vocab_path, make_model, mtp_tensors, preset_config, tensor_qtype, tokenizer_metadata
from engine.gguf.names import expected_tensors, is_expert_tensor
from engine.gguf.reader import GGUFFile
from engine.gguf.writer import write_gguf
from engine.model.config import ModelConfig

def _find_vocab() -> Path | None:
    try:
        return default_vocab_path()
    except ConfigError:
        return None


VOCAB = _find_vocab()
pytestmark = pytest.mark.skipif(VOCAB is None, reason="shared/data vocabulary GGUF not present")


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> Path:
    """The tiny preset's vocabulary, written once: truncating it again changes nothing, and
    parsing 2K tokens instead of 150K keeps each make_model call fast."""
    md = {"general.architecture": "qwen2"} | tokenizer_metadata(VOCAB, n_ordinary=TINY_ORDINARY_TOKENS)
    return write_gguf(tmp_path_factory.mktemp("vocab") / "tiny-vocab.gguf", md, [])


@pytest.fixture
def write(tmp_path, small_vocab):
    def make(name="m.gguf", **kw):
        return make_model(tmp_path / name, "tiny", vocab_path=small_vocab, **kw)
    return make


def read_config(f: GGUFFile) -> ModelConfig:
    return ModelConfig.from_metadata(f.metadata, source=str(f.path))


@pytest.mark.parametrize("kw", [
    dict(quant="f32"), dict(quant="q8_0"), dict(quant="q4_k"), dict(quant="bf16", fused_experts=True),
    dict(quant="q4_0", expert_quant="f16", mtp=True)], ids=lambda kw: "-".join(map(str, kw.values())))
def test_tiny_reads_back_with_expected_tensors(write, kw):
    path = write(**kw)
    assert path.stat().st_size < 4 * 2**20
    with GGUFFile(path, architecture="qwen35moe") as f:
        cfg = read_config(f)
        assert (cfg.n_layers, cfg.hidden, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rope_dim) == (4, 64, 4, 2, 32, 8)
        assert (cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_head_k, cfg.gdn_head_v, cfg.conv_kernel) == (2, 4, 16, 16, 4)
        assert (cfg.n_expert, cfg.n_expert_used, cfg.expert_ffn, cfg.shared_ffn) == (8, 2, 32, 32)
        assert cfg.attention_layers == [3] and cfg.rms_eps == 1e-6 and cfg.rope_theta == 1e7
        assert cfg.rope_sections == (2, 1, 1, 0)
        expected = expected_tensors(cfg, fused_experts=kw.get("fused_experts", False))
        f.check_tensors(expected)
        extra = set(f.tensors) - set(expected)
        if kw.get("mtp"):
            assert cfg.n_nextn == 1 and f.metadata["qwen35moe.block_count"] == 5
            assert extra == set(mtp_tensors(cfg))
            f.check_tensors(mtp_tensors(cfg))
            assert f.tensors["blk.4.nextn.eh_proj.weight"].shape == (64, 128)
            assert "blk.4.attn_q.weight" in f.tensors and "blk.4.attn_qkv.weight" not in f.tensors
        else:
            assert extra == set()
        quant = {"f32": Q.F32, "q8_0": Q.Q8_0, "q4_k": Q.Q4_K, "bf16": Q.BF16, "q4_0": Q.Q4_0}[kw["quant"]]
        for name, info in f.tensors.items():
            if len(info.shape) == 1 or "norm" in name or name.endswith(
                    ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")):
                assert info.qtype == Q.F32, name
            elif kw.get("expert_quant") and is_expert_tensor(name):
                assert info.qtype == Q.F16, name
            elif quant == Q.Q4_K:
                assert info.qtype == Q.Q8_0, name  # no tiny row is a multiple of 256: llama.cpp-style fallback
            else:
                assert info.qtype == quant, name
        for name in f.tensors:
            assert torch.isfinite(f.load(name)).all(), name


def test_tokenizer_is_truncated_consistently(tmp_path, small_vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    with GGUFFile(make_model(tmp_path / "m.gguf", "tiny", vocab_path=VOCAB)) as f:
        md = f.metadata
    with GGUFFile(small_vocab) as f:
        again = {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}
    assert again == {k: v for k, v in md.items() if k.startswith("tokenizer.")}
    tokens, types, merges = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], md["tokenizer.ggml.merges"]
    assert len(tokens) == len(types) == 2048 + 293 == read_config_from(md).vocab
    assert all(t == TokenType.NORMAL for t in types[:2048]) and TokenType.NORMAL not in types[2048:]
    assert tokens[md["tokenizer.ggml.eos_token_id"]] == "<|endoftext|>"
    assert tokens[md["tokenizer.ggml.bos_token_id"]] == "<|endoftext|>"
    assert tokens[2049:2051] == ["<|im_start|>", "<|im_end|>"]
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen35"
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(merges) > 1500
    pairs = [tuple(m.split(" ")) for m in merges]
    assert all(a in vocab and b in vocab and a + b in vocab for a, b in pairs)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    text = "Hello world, the tokenizer still works: 123 + 456."
    ids = bpe.encode(text).ids
    assert max(ids) < 2048 and len(ids) < len(text)
    assert bpe.decode(ids) == text


def read_config_from(md) -> ModelConfig:
    return ModelConfig.from_metadata(md)


def test_weight_scales_give_a_sane_forward(write):
    path = write(quant="q8_0", seed=3)
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # unit RMS, as after an RMSNorm
    with GGUFFile(path) as f:
        cfg = read_config(f)
        for name, info in f.tensors.items():
            w = f.load(name)
            if name.endswith("norm.weight"):
                assert abs(w.mean().item() - 1) < 0.05 and w.std().item() < 0.1, name
            elif name.endswith("ssm_a"):
                assert (w <= -1).all() and (w >= -16).all(), name
            elif name.endswith("ssm_dt.bias"):
                assert w.abs().max() < 0.5, name
            elif name.endswith("ssm_conv1d.weight"):
                assert abs(w.std().item() * 2 - 1) < 0.2, name  # N(0, 1/kernel)
            elif name == "token_embd.weight":
                assert abs(w.std().item() - 1) < 0.05, name
            elif len(info.shape) >= 2 and info.shape[-1] in (64, 32, 128):
                inp = torch.randn(256, info.shape[-1])
                inp = inp / inp.pow(2).mean(-1, keepdim=True).sqrt()
                out = inp @ w.reshape(-1, info.shape[-1]).T
                rms = out.pow(2).mean().sqrt().item()
                assert 0.8 < rms < 1.25, f"{name}: output RMS {rms:.2f} for unit-RMS input"
        assert cfg.vocab == f.tensors["output.weight"].shape[0]


def route_shares(path: Path) -> list[float]:
    """Share of top-k slots taken by the most used expert in each layer, over every token."""
    shares = []
    with GGUFFile(path) as f:
        cfg = read_config(f)
        emb = f.load("token_embd.weight")
        h = emb / emb.pow(2).mean(-1, keepdim=True).add(cfg.rms_eps).sqrt()
        for layer in range(cfg.n_layers):
            logits = (h * f.load(f"blk.{layer}.post_attention_norm.weight")) @ f.load(f"blk.{layer}.ffn_gate_inp.weight").T
            top = logits.topk(cfg.n_expert_used, dim=-1).indices.flatten()
            shares.append(torch.bincount(top, minlength=cfg.n_expert).max().item() / top.numel())
    return shares


def test_router_skew_concentrates_routing(write):
    flat = route_shares(write("flat.gguf", seed=1))
    skewed = route_shares(write("skew.gguf", seed=1, router_skew=2.0))
    assert max(flat) < 0.2  # uniform is 1/8 = 0.125
    assert min(skewed) > 0.35  # at most 0.5 with top-2


def test_same_seed_same_bytes_other_seed_other_weights(write):
    a = write("a.gguf", quant="q4_0", seed=7)
    b = write("b.gguf", quant="q4_0", seed=7)
    c = write("c.gguf", quant="q4_0", seed=8)
    assert a.read_bytes() == b.read_bytes()
    with GGUFFile(a) as fa, GGUFFile(c) as fc:
        assert not torch.equal(fa.load("blk.0.attn_qkv.weight"), fc.load("blk.0.attn_qkv.weight"))


def test_progress_and_inspect(write):
    seen = []
    path = write(quant="q8_0", mtp=True, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1][0] == seen[-1][1] and [d for d, _ in seen] == sorted(d for d, _ in seen)
    s = summarize(path)
    assert s["architecture"] == "qwen35moe" and s["vocab_size"] == 2341 and s["mtp"] and s["mtp_layers"] == 1
    assert s["tokenizer_model"] == "gpt2" and s["tokenizer_pre"] == "qwen35"
    assert s["hyperparameters"]["block_count"] == 5 and s["hyperparameters"]["expert_count"] == 8
    with GGUFFile(path) as f:
        counts = Counter(i.qtype.name for i in f.tensors.values())
        assert s["tensor_count"] == len(f.tensors) and {k: v["count"] for k, v in s["by_type"].items()} == counts
        assert s["tensor_bytes"] == sum(i.nbytes for i in f.tensors.values()) == seen[-1][1]
    console = Console(record=True, width=120)
    console.print(render(s))
    text = console.export_text()
    assert "qwen35moe" in text and "Q8_0" in text and "2341 tokens" in text and "MTP" in text


def test_inspect_a_vocab_only_file():
    s = summarize(VOCAB)
    assert s["architecture"] == "qwen2" and s["tensor_count"] == 0 and s["vocab_size"] == 151936 and not s["mtp"]
    Console(record=True).print(render(s))


def test_real_preset_shapes_and_size():
    cfg = preset_config("qwen3.6-35b-a3b", vocab=248320)
    assert (cfg.n_layers, cfg.hidden, cfg.vocab, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == (40, 2048, 248320, 16, 2, 256)
    assert (cfg.rope_dim, cfg.rope_sections, cfg.rope_theta, cfg.context_length) == (64, (11, 11, 10, 0), 1e7, 262144)
    assert (cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_head_k, cfg.gdn_conv_dim) == (16, 32, 128, 8192)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.expert_ffn, cfg.shared_ffn) == (256, 8, 512, 512)
    assert len(cfg.attention_layers) == 10 and len(cfg.gdn_layers) == 30
    shapes = expected_tensors(cfg)
    total = sum(quants.tensor_nbytes(tensor_qtype(n, s, Q.Q4_0), s) for n, s in shapes.items())
    assert 19.4e9 < total < 19.8e9  # the 19.6 GB all-Q4_0 file measured with llama.cpp


def test_fallback_types():
    assert tensor_qtype("blk.0.ffn_up_exps.weight", (8, 32, 64), Q.Q4_K) == Q.Q8_0
    assert tensor_qtype("blk.0.ffn_up_exps.weight", (8, 32, 256), Q.Q4_K) == Q.Q4_K
    assert tensor_qtype("blk.0.ffn_up_exps.weight", (8, 32, 256), Q.Q4_K, Q.Q6_K) == Q.Q6_K
    assert tensor_qtype("blk.0.ssm_conv1d.weight", (8192, 4), Q.Q8_0) == Q.F32
    assert tensor_qtype("blk.0.ffn_gate_inp.weight", (256, 2048), Q.Q8_0) == Q.F32
    assert tensor_qtype("blk.0.attn_q.weight", (64, 48), Q.Q8_0) == Q.F16


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        make_model(tmp_path / "m.gguf", "huge", vocab_path=VOCAB)
    with pytest.raises(ConfigError, match="unknown quant 'q3_k'"):
        make_model(tmp_path / "m.gguf", quant="q3_k", vocab_path=VOCAB)
    with pytest.raises(ConfigError, match="expert_used_count 2 exceeds expert_count 1"):
        make_model(tmp_path / "m.gguf", n_expert=1, vocab_path=VOCAB)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_real_preset_with_few_layers_writes_k_quants(tmp_path):
    path = make_model(tmp_path / "real.gguf", "qwen3.6-35b-a3b", n_layers=1, n_expert=8, quant="q4_k",
                      expert_quant="q6_k", mtp=True, vocab_path=VOCAB)
    with GGUFFile(path) as f:
        cfg = read_config(f)
        assert cfg.vocab == 248320 and cfg.n_nextn == 1
        f.check_tensors(expected_tensors(cfg) | mtp_tensors(cfg))
        types = f.metadata["tokenizer.ggml.token_type"]
        assert types[151936:] == [TokenType.UNUSED] * (248320 - 151936)
        assert f.tensors["token_embd.weight"].qtype == Q.Q4_K
        assert f.tensors["blk.0.ffn_down_exps.weight"].qtype == Q.Q6_K
        w = f.load("blk.0.ffn_down_exps.weight")
        assert abs(w.std().item() * np.sqrt(512) - 1) < 0.05
