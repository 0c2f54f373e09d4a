"""convert_hf writes what llama.cpp's converter writes: keys and their types, tensor names,
shapes and types, and every value transform."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFValueType as V

from engine.errors import ConfigError
from engine.gguf import names
from engine.gguf.convert_hf import config_from_hf, convert_hf, hf_text_config
from engine.gguf.reader import GGUFFile
from engine.model.value_heads import to_tiled

K, VH, DV, KEY_DIM = 2, 4, 16, 2 * 16


def hf(model, name):
    return model.state_dict()[name].float()


def test_metadata_keys_and_types(gguf_path, hf_model):
    with GGUFFile(gguf_path) as f:
        md, types = f.metadata, f.metadata_types
    expect = {
        "general.architecture": ("qwen35moe", V.STRING), "general.type": ("model", V.STRING),
        "general.file_type": (0, V.UINT32), "general.quantization_version": (2, V.UINT32),
        "qwen35moe.block_count": (8, V.UINT32), "qwen35moe.context_length": (1024, V.UINT32),
        "qwen35moe.embedding_length": (64, V.UINT32), "qwen35moe.attention.head_count": (4, V.UINT32),
        "qwen35moe.attention.head_count_kv": (2, V.UINT32), "qwen35moe.attention.key_length": (32, V.UINT32),
        "qwen35moe.attention.value_length": (32, V.UINT32),
        "qwen35moe.attention.layer_norm_rms_epsilon": (1e-6, V.FLOAT32),
        "qwen35moe.rope.freq_base": (10000.0, V.FLOAT32), "qwen35moe.rope.dimension_count": (8, V.UINT32),
        "qwen35moe.rope.dimension_sections": ([2, 1, 1, 0], V.ARRAY),
        "qwen35moe.expert_count": (8, V.UINT32), "qwen35moe.expert_used_count": (3, V.UINT32),
        "qwen35moe.expert_feed_forward_length": (24, V.UINT32),
        "qwen35moe.expert_shared_feed_forward_length": (40, V.UINT32),
        "qwen35moe.ssm.conv_kernel": (4, V.UINT32), "qwen35moe.ssm.state_size": (16, V.UINT32),
        "qwen35moe.ssm.group_count": (2, V.UINT32), "qwen35moe.ssm.time_step_rank": (4, V.UINT32),
        "qwen35moe.ssm.inner_size": (64, V.UINT32), "qwen35moe.full_attention_interval": (4, V.UINT32),
        "qwen35moe.vocab_size": (101, V.UINT32),
    }
    for key, (value, vtype) in expect.items():
        assert md[key] == value, key
        assert types[key][0] == vtype, key
    assert types["qwen35moe.rope.dimension_sections"][1] == V.INT32


def test_tensor_names_and_shapes_are_the_loaders(gguf_path, hf_model):
    cfg = config_from_hf(hf_text_config(hf_model.config))
    with GGUFFile(gguf_path) as f:
        assert {n: t.shape for n, t in f.tensors.items()} == names.expected_tensors(cfg)
        assert f.tensors["blk.0.ffn_gate_inp_shexp.weight"].shape == (1, 64)


@pytest.mark.parametrize("quant, matrix_type, file_type", [("bf16", Q.BF16, 32), ("q8_0", Q.Q8_0, 7)])
def test_tensor_types_follow_llama_cpp(hf_model, tmp_path, quant, matrix_type, file_type):
    with GGUFFile(convert_hf(hf_model, tmp_path / "m.gguf", quant=quant)) as f:
        assert f.metadata["general.file_type"] == file_type
        types = {n: t.qtype for n, t in f.tensors.items()}
    for name, qtype in types.items():
        if name.endswith(("norm.weight", "ssm_a", "ssm_dt.bias", "ffn_gate_inp.weight",
                          "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")):
            assert qtype == Q.F32, name
        elif quant == "q8_0" and name.endswith(("ffn_down_exps.weight", "ffn_down_shexp.weight")):
            assert qtype == Q.F16, name  # rows of 24 and 40 values are not Q8_0 blocks of 32
        else:
            assert qtype == matrix_type, name


def test_value_transforms(gguf_path, hf_model):
    m = hf_model
    with GGUFFile(gguf_path) as f:
        def g(name):
            return f.load(name)

        # norms are stored as 1 + w, except the GDN's gated norm
        torch.testing.assert_close(g("output_norm.weight"), hf(m, "model.norm.weight") + 1)
        torch.testing.assert_close(g("blk.3.attn_q_norm.weight"), hf(m, "model.layers.3.self_attn.q_norm.weight") + 1)
        torch.testing.assert_close(g("blk.1.post_attention_norm.weight"),
                                   hf(m, "model.layers.1.post_attention_layernorm.weight") + 1)
        torch.testing.assert_close(g("blk.0.ssm_norm.weight"), hf(m, "model.layers.0.linear_attn.norm.weight"))
        # q_proj keeps its per-head [q | gate] rows
        torch.testing.assert_close(g("blk.3.attn_q.weight"), hf(m, "model.layers.3.self_attn.q_proj.weight"))
        # ssm_a = -exp(A_log), ssm_dt.bias = dt_bias, both re-tiled over value heads
        a_log = hf(m, "model.layers.0.linear_attn.A_log")
        torch.testing.assert_close(g("blk.0.ssm_a"), to_tiled(-torch.exp(a_log), 0, K, VH, 1))
        torch.testing.assert_close(g("blk.0.ssm_dt.bias"), to_tiled(hf(m, "model.layers.0.linear_attn.dt_bias"), 0, K, VH, 1))
        # conv1d squeezed to [C, K]; its V channels re-tiled, q/k channels untouched
        conv = hf(m, "model.layers.0.linear_attn.conv1d.weight").squeeze(1)
        ours = g("blk.0.ssm_conv1d.weight")
        torch.testing.assert_close(ours[:2 * KEY_DIM], conv[:2 * KEY_DIM])
        torch.testing.assert_close(ours[2 * KEY_DIM:], to_tiled(conv[2 * KEY_DIM:], 0, K, VH, DV))
        # out_proj: columns re-tiled
        torch.testing.assert_close(g("blk.0.ssm_out.weight"),
                                   to_tiled(hf(m, "model.layers.0.linear_attn.out_proj.weight"), 1, K, VH, DV))
        # fused gate_up [E, 2F, H]: gate is the first F rows of each expert
        gate_up = hf(m, "model.layers.2.mlp.experts.gate_up_proj")
        torch.testing.assert_close(g("blk.2.ffn_gate_exps.weight"), gate_up[:, :24])
        torch.testing.assert_close(g("blk.2.ffn_up_exps.weight"), gate_up[:, 24:])
        torch.testing.assert_close(g("blk.2.ffn_down_exps.weight"), hf(m, "model.layers.2.mlp.experts.down_proj"))
        torch.testing.assert_close(g("blk.2.ffn_gate_inp_shexp.weight"),
                                   hf(m, "model.layers.2.mlp.shared_expert_gate.weight"))


def _same_tensors(a, b):
    with GGUFFile(a) as fa, GGUFFile(b) as fb:
        assert fa.tensors.keys() == fb.tensors.keys()
        for name in fa.tensors:
            torch.testing.assert_close(fa.load(name), fb.load(name), rtol=0, atol=0, msg=name)


def test_multimodal_per_expert_checkpoint_gives_the_same_file(hf_model, gguf_path, tmp_path):
    sd = {}
    for name, t in hf_model.state_dict().items():
        prefix, _, rest = name.partition(".experts.")
        if rest == "gate_up_proj":
            for e in range(t.shape[0]):
                sd[f"{prefix}.experts.{e}.gate_proj.weight"] = t[e, :24]
                sd[f"{prefix}.experts.{e}.up_proj.weight"] = t[e, 24:]
        elif rest == "down_proj":
            for e in range(t.shape[0]):
                sd[f"{prefix}.experts.{e}.down_proj.weight"] = t[e]
        else:
            sd[name] = t
    sd = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t for n, t in sd.items()}
    sd["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    sd["mtp.fc.weight"] = torch.zeros(64, 128)
    config = {"model_type": "qwen3_5_moe", "text_config": hf_text_config(hf_model.config), "vision_config": {}}
    _same_tensors(convert_hf(sd, tmp_path / "pe.gguf", config=config), gguf_path)


def test_checkpoint_directory(hf_model, gguf_path, tmp_path):
    hf_model.save_pretrained(tmp_path / "ckpt")
    out = convert_hf(tmp_path / "ckpt", tmp_path / "dir.gguf")
    _same_tensors(out, gguf_path)
    with GGUFFile(out) as f:
        assert f.metadata["general.name"] == "ckpt"


def test_tokenizer_metadata_is_stored(hf_model, tmp_path):
    tokens = [f"t{i}" for i in range(101)]
    tok = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
           "tokenizer.ggml.token_type": [1] * 101, "tokenizer.ggml.eos_token_id": 100}
    with GGUFFile(convert_hf(hf_model, tmp_path / "t.gguf", tokenizer_metadata=tok)) as f:
        assert f.metadata["tokenizer.ggml.tokens"] == tokens
        assert f.metadata_types["tokenizer.ggml.eos_token_id"][0] == V.UINT32
        assert "qwen35moe.vocab_size" not in f.metadata
    with pytest.raises(ConfigError, match="100 tokens"):
        convert_hf(hf_model, tmp_path / "u.gguf", tokenizer_metadata={**tok, "tokenizer.ggml.tokens": tokens[:100]})


def test_bad_inputs_raise_config_errors(hf_model, tmp_path):
    with pytest.raises(ConfigError, match="quant"):
        convert_hf(hf_model, tmp_path / "x.gguf", quant="q3_k")
    with pytest.raises(ConfigError, match="config.json"):
        convert_hf(tmp_path, tmp_path / "x.gguf")
    sd = dict(hf_model.state_dict())
    sd["model.layers.0.linear_attn.mystery.weight"] = torch.zeros(2)
    with pytest.raises(ConfigError, match="mystery"):
        convert_hf(sd, tmp_path / "x.gguf", config=hf_model.config)
    del sd["model.layers.0.linear_attn.mystery.weight"]
    del sd["model.layers.5.mlp.shared_expert.up_proj.weight"]
    with pytest.raises(ConfigError, match="blk.5.ffn_up_shexp.weight"):
        convert_hf(sd, tmp_path / "x.gguf", config=hf_model.config)
    assert not (tmp_path / "x.gguf").exists()


def test_checkpoint_tokenizer_becomes_gguf_vocabulary(hf_model_factory, tmp_path):
    """A byte-level BPE tokenizer.json beside the checkpoint is stored as llama.cpp stores it,
    and the engine's tokenizer reads it back to the same ids as the HF tokenizer."""
    import json

    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    from engine.tokenizer import Tokenizer

    text = "the cat sat on the mat, and the dog sat on the log; then the cat ran after the dog. " * 20
    hf_tok = HFTokenizer(models.BPE())
    hf_tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf_tok.decoder = decoders.ByteLevel()
    hf_tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf_tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    n_trained = hf_tok.get_vocab_size() - 3

    ckpt = tmp_path / "ckpt"
    hf_model_factory(vocab_size=300).save_pretrained(ckpt)
    hf_tok.save(str(ckpt / "tokenizer.json"))
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": template}))

    with GGUFFile(convert_hf(ckpt, tmp_path / "tok.gguf")) as f:
        md, types = f.metadata, f.metadata_types
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == 300 and md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen35"
    assert tokens[n_trained:n_trained + 3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokens[299] == "[PAD299]"
    assert md["tokenizer.ggml.token_type"][:3] == [1, 1, 1]
    assert md["tokenizer.ggml.token_type"][n_trained:n_trained + 3] == [3, 3, 3]  # CONTROL
    assert md["tokenizer.ggml.token_type"][-1] == 5  # UNUSED
    assert md["tokenizer.ggml.eos_token_id"] == n_trained + 2 and types["tokenizer.ggml.eos_token_id"][0] == V.UINT32
    assert md["tokenizer.ggml.padding_token_id"] == n_trained
    assert md["tokenizer.chat_template"] == template
    assert "qwen35moe.vocab_size" not in md

    ours = Tokenizer.from_metadata(md, source="tok.gguf")
    sample = "the dog ran after the cat on the mat"
    assert ours.encode(sample) == hf_tok.encode(sample).ids
    assert ours.decode(hf_tok.encode(sample).ids) == sample
