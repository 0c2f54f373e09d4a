"""Draft files: the Lucebox GGUF layout round trip, other converters' names, z-lab's layout, bad files."""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFValueType

from engine.dflash.draft import DFlashDraft, DraftConfig
from engine.dflash.gguf_io import (ARCH, DraftFile, config_to_metadata, expected_shapes, gguf_tensor_names,
                                   load_draft, write_draft_gguf, zlab_tensor_names)
from engine.errors import GGUFError
from engine.gguf.reader import GGUFFile
from engine.gguf.writer import TensorSpec, write_gguf

CFG = DraftConfig(n_layers=2, hidden=32, ffn=48, n_head=4, n_head_kv=2, head_dim=8, rms_eps=1e-6, rope_theta=1e7,
                  block_size=16, mask_token_id=7, target_layer_ids=(1, 10, 19), vocab=60)


@pytest.fixture(scope="module")
def draft():
    d = DFlashDraft(CFG).init_random(torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 1:  # norms away from one, so that a swapped norm shows
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return d


def _assert_same(a, b, **tol):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        torch.testing.assert_close(pb[name].float(), pa[name].float(), **(tol or {"atol": 0, "rtol": 0}), msg=name)


def test_gguf_round_trip_is_exact_in_f32(draft, tmp_path):
    path = write_draft_gguf(draft, tmp_path / "d.gguf", qtype="f32")
    loaded = DraftFile.open(path)
    assert loaded.cfg == CFG and loaded.layout == "gguf"
    _assert_same(draft, loaded.load())


def test_gguf_keys_and_types_follow_lucebox(draft, tmp_path):
    path = write_draft_gguf(draft, tmp_path / "d.gguf", qtype="bf16")
    with GGUFFile(path) as f:
        md, types = f.metadata, f.metadata_types
        assert md["general.architecture"] == ARCH == "qwen35-dflash-draft"
        assert md[f"{ARCH}.dflash.block_size"] == 16 and md[f"{ARCH}.dflash.mask_token_id"] == 7
        assert md[f"{ARCH}.dflash.target_layer_ids"] == [1, 10, 19]
        assert types[f"{ARCH}.dflash.target_layer_ids"] == (GGUFValueType.ARRAY, GGUFValueType.INT32)
        assert md[f"{ARCH}.dflash.n_target_layers"] == 3
        assert md[f"{ARCH}.embedding_length"] == 32 and md[f"{ARCH}.block_count"] == 2
        assert f.tensors["dflash.fc.weight"].shape == (32, 96) and f.tensors["dflash.fc.weight"].qtype == Q.BF16
        assert f.tensors["dflash.hidden_norm.weight"].qtype == Q.F32
        assert {"blk.1.ffn_norm.weight", "blk.1.attn_q_norm.weight", "output_norm.weight"} <= set(f.tensors)
        assert len(f.tensors) == 3 + 11 * CFG.n_layers
    _assert_same(draft, load_draft(path), atol=1e-2, rtol=1e-2)  # bf16 rounding


def test_other_converters_tensor_names_load(draft, tmp_path):
    renamed = {"dflash.fc.weight": "dflash_fc.weight", "dflash.hidden_norm.weight": "dflash_hidden_norm.weight",
               "blk.0.ffn_norm.weight": "blk.0.post_attention_norm.weight"}
    params = dict(draft.named_parameters())
    specs = [TensorSpec(renamed.get(name, name), tuple(params[p].shape), Q.F32,
                        lambda t=params[p]: t.detach().numpy().astype(np.float32))
             for p, name in gguf_tensor_names(CFG).items()]
    md = config_to_metadata(CFG)
    md = {k.replace(ARCH, "dflash-draft"): v for k, v in md.items()} | {"general.architecture": "dflash-draft"}
    path = write_gguf(tmp_path / "fork.gguf", md, specs)
    _assert_same(draft, load_draft(path))


def _write_zlab(draft, directory, config_overrides=None, prefix=""):
    from safetensors.torch import save_file

    directory.mkdir()
    params = dict(draft.named_parameters())
    save_file({prefix + hf: params[p].detach().contiguous() for p, hf in zlab_tensor_names(CFG).items()},
              directory / "model.safetensors")
    config = {"architectures": ["DFlashDraftModel"], "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "rms_norm_eps": 1e-6, "rope_theta": 1e7, "vocab_size": 60, "max_position_embeddings": 32768,
              "block_size": 16, "num_target_layers": 40,
              "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 10, 19]}}
    (directory / "config.json").write_text(json.dumps(config | (config_overrides or {})))
    return directory


@pytest.mark.parametrize("prefix", ["", "model."])
def test_zlab_layout_loads_the_same_draft(draft, tmp_path, prefix):
    directory = _write_zlab(draft, tmp_path / "zlab", prefix=prefix)
    for path in (directory, directory / "model.safetensors"):
        f = DraftFile.open(path)
        assert f.layout == "zlab" and f.cfg == CFG
        _assert_same(draft, f.load())


def test_zlab_then_gguf_conversion_keeps_weights(draft, tmp_path):
    zlab = load_draft(_write_zlab(draft, tmp_path / "zlab"))
    _assert_same(draft, load_draft(write_draft_gguf(zlab, tmp_path / "converted.gguf", qtype="f32")))


@pytest.mark.parametrize("overrides, message", [
    ({"architectures": ["DFlash2DraftModel"]}, "architecture 'DFlash2DraftModel' is not supported"),
    ({"dflash_config": {"mask_token_id": 7}}, "config key 'target_layer_ids' is missing"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope scaling .* is not supported"),
    ({"num_key_value_heads": 3}, "inconsistent draft hyperparameters"),
])
def test_bad_zlab_configs_are_refused(draft, tmp_path, overrides, message):
    with pytest.raises(GGUFError, match=message):
        DraftFile.open(_write_zlab(draft, tmp_path / "zlab", overrides))


def test_missing_key_wrong_shape_and_wrong_arch_are_named(draft, tmp_path):
    md = config_to_metadata(CFG)
    shapes = expected_shapes(CFG)
    names = gguf_tensor_names(CFG)

    def specs(bad=None):
        out = []
        for p, name in names.items():
            shape = (3,) if name == bad else shapes[p]
            out.append(TensorSpec(name, shape, Q.F32, lambda s=shape: np.zeros(s, np.float32)))
        return out

    no_block = {k: v for k, v in md.items() if not k.endswith("dflash.block_size")}
    with pytest.raises(GGUFError, match=f"metadata key '{ARCH}.dflash.block_size' is missing"):
        DraftFile.open(write_gguf(tmp_path / "a.gguf", no_block, specs()))
    with pytest.raises(GGUFError, match=r"tensor 'blk.1.attn_k.weight' has shape \(3,\), expected \(16, 32\)"):
        load_draft(write_gguf(tmp_path / "b.gguf", md, specs("blk.1.attn_k.weight")))
    with pytest.raises(GGUFError, match="architecture is 'qwen35moe', expected 'qwen35-dflash-draft'"):
        DraftFile.open(write_gguf(tmp_path / "c.gguf", md | {"general.architecture": "qwen35moe"}, specs()))
    wrong_count = md | {f"{ARCH}.dflash.n_target_layers": 5}
    with pytest.raises(GGUFError, match="n_target_layers is 5 but dflash.target_layer_ids lists 3"):
        DraftFile.open(write_gguf(tmp_path / "d.gguf", wrong_count, specs()))
    with pytest.raises(GGUFError, match="z-lab draft needs .*config.json"):
        DraftFile.open(tmp_path)
