"""A draft that does not fit its target is refused from metadata alone, fast, naming both sides."""

import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.dflash.compat import check_compatible, check_spec_len, open_compatible
from engine.dflash.draft import DraftConfig
from engine.dflash.gguf_io import config_to_metadata, expected_shapes, gguf_tensor_names
from engine.errors import ConfigError, IncompatibleModelError
from engine.gguf.make_model import preset_config
from engine.gguf.writer import TensorSpec, write_gguf

TARGET_35B = preset_config("qwen3.6-35b-a3b", vocab=248320)


def _draft_cfg(**overrides):
    kw = dict(n_layers=5, hidden=2048, ffn=6144, n_head=16, n_head_kv=4, head_dim=128, rms_eps=1e-6, rope_theta=1e7,
              block_size=16, mask_token_id=248070, target_layer_ids=(1, 10, 19, 28, 37), vocab=248320)
    return DraftConfig(**(kw | overrides))


def test_matching_draft_passes():
    check_compatible(_draft_cfg(), TARGET_35B, draft_name="D.gguf", target_name="T.gguf")
    check_compatible(_draft_cfg(vocab=0), TARGET_35B, draft_name="D.gguf", target_name="T.gguf")


@pytest.mark.parametrize("overrides, message", [
    ({"hidden": 5120, "target_layer_ids": (1, 16, 31, 46, 61)},
     "draft D.gguf has hidden size 5120 but target T.gguf has 2048"),
    ({"vocab": 151936, "mask_token_id": 151669},
     "draft D.gguf has a vocabulary of 151936 tokens but target T.gguf has 248320"),
    ({"vocab": 0, "mask_token_id": 300000},
     r"draft D.gguf uses mask token id 300000, outside the vocabulary of target T.gguf \(248320 tokens\)"),
    ({"target_layer_ids": (1, 16, 31, 46, 61)},
     r"draft D.gguf reads target layers \[1, 16, 31, 46, 61\] but target T.gguf has 40 layers \(ids 0..39\)"),
])
def test_mismatches_name_both_sides(overrides, message):
    with pytest.raises(IncompatibleModelError, match=message):
        check_compatible(_draft_cfg(**overrides), TARGET_35B, draft_name="D.gguf", target_name="T.gguf")


def _write_header_only_sized(path, cfg):
    """A complete draft GGUF of ``cfg`` (zero F16 weights), written without building the model."""
    shapes = expected_shapes(cfg)
    specs = [TensorSpec(name, shapes[p], Q.F16 if len(shapes[p]) == 2 else Q.F32,
                        lambda s=shapes[p]: np.zeros(int(np.prod(s)) * (2 if len(s) == 2 else 4), np.uint8))
             for p, name in gguf_tensor_names(cfg).items()]
    return write_gguf(path, config_to_metadata(cfg), specs)


def test_dense_27b_draft_is_refused_within_a_second(target, target_path, tmp_path):
    """The failure that started the project: a hidden-5120 draft against a smaller target."""
    big = _draft_cfg(n_layers=1, hidden=5120, ffn=64, n_head=1, n_head_kv=1, target_layer_ids=(1,), vocab=0,
                     mask_token_id=5)
    path = _write_header_only_sized(tmp_path / "dense-27b-draft.gguf", big)
    assert path.stat().st_size > 50e6  # the refusal must not depend on reading the tensors
    start = time.perf_counter()
    with pytest.raises(IncompatibleModelError,
                       match=f"draft dense-27b-draft.gguf has hidden size 5120 but target {target_path.name} has "
                             f"{target.cfg.hidden}"):
        open_compatible(path, target.cfg, target_name=target_path.name)
    assert time.perf_counter() - start < 1.0


def test_compatible_file_opens_and_loads(random_draft_path, target, target_path):
    draft_file = open_compatible(random_draft_path, target.cfg, target_name=target_path.name)
    assert draft_file.cfg.hidden == target.cfg.hidden
    assert draft_file.load().cfg == draft_file.cfg


@pytest.mark.parametrize("spec_len", [1, 17])
def test_spec_len_must_fit_the_block(spec_len):
    with pytest.raises(ConfigError, match=f"between 2 and the draft's block size 16, got {spec_len}"):
        check_spec_len(spec_len, _draft_cfg())
    check_spec_len(2, _draft_cfg())
    check_spec_len(16, _draft_cfg())
