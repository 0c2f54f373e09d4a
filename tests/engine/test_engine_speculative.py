"""Engine-level DFlash and PFlash: speculative decoding after plain or compressed prefill."""

import pytest
import torch

from engine.dflash.draft import DFlashDraft, DraftConfig
from engine.dflash.gguf_io import write_draft_gguf
from engine.engine import Engine
from engine.errors import ConfigError
from engine.gguf.make_model import make_model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    target = make_model(root / "target.gguf", "tiny", seed=3)
    drafter = make_model(root / "drafter.gguf", "tiny", seed=11, n_layers=4)
    eng = Engine.from_gguf(target, device="cpu")
    cfg = DraftConfig(n_layers=2, hidden=eng.config.hidden, ffn=96, n_head=4, n_head_kv=2, head_dim=16,
                      rms_eps=1e-6, rope_theta=1e7, block_size=8, mask_token_id=eng.config.vocab - 1,
                      target_layer_ids=(0, 2), vocab=eng.config.vocab)
    draft = write_draft_gguf(DFlashDraft(cfg).init_random(torch.Generator().manual_seed(0)),
                             root / "draft.gguf", qtype="f32")
    return target, draft, drafter


@pytest.fixture(scope="module")
def eng(files):
    target, draft, drafter = files
    return Engine.from_gguf(target, device="cpu", draft=draft, drafter=drafter, pflash_threshold=16)


def long_prompt(eng, n=96):
    return torch.randint(0, eng.config.vocab - 1, (n,), generator=torch.Generator().manual_seed(2)).tolist()


@pytest.mark.parametrize("spec_len", [2, 4, 8])
def test_speculative_greedy_equals_plain(eng, spec_len):
    ids = eng.tokenizer.encode("def add(a, b):")
    plain = eng.generate(ids, 24, ignore_eos=True)
    spec = eng.generate(ids, 24, ignore_eos=True, spec_len=spec_len)
    assert spec.ids == plain.ids
    assert spec.timings.extra["acceptance_length"] >= 1.0
    assert spec.timings.extra["verify_steps"] > 0


def test_dflash_after_pflash_equals_plain_decode_after_pflash(eng):
    ids = long_prompt(eng)
    compressed = eng.generate(ids, 16, ignore_eos=True, pflash_keep_ratio=0.5)
    assert compressed.timings.extra["pflash_kept_tokens"] < len(ids)
    both = eng.generate(ids, 16, ignore_eos=True, pflash_keep_ratio=0.5, spec_len=4)
    assert both.ids == compressed.ids
    assert both.timings.extra["pflash_kept_tokens"] == compressed.timings.extra["pflash_kept_tokens"]


def test_keep_ratio_one_with_dflash_equals_plain(eng):
    ids = long_prompt(eng)
    assert eng.generate(ids, 12, ignore_eos=True, pflash_keep_ratio=1.0, spec_len=4).ids == \
        eng.generate(ids, 12, ignore_eos=True).ids


def test_spec_len_without_a_draft_is_refused(files):
    eng = Engine.from_gguf(files[0], device="cpu")
    with pytest.raises(ConfigError, match="needs a DFlash draft"):
        eng.generate([1, 2, 3], 4, spec_len=4)


def test_spec_len_beyond_block_size_is_refused(eng):
    with pytest.raises(ConfigError, match="spec_len"):
        eng.generate([1, 2, 3], 4, spec_len=64)


def test_default_generation_hands_unpredictable_stretches_to_plain_decoding(eng):
    """With the engine's defaults a draft that never helps (random) hands the generation to plain
    decoding after 8 verify steps, tries again after 32 plain tokens, and the timings and the
    CLI's line say so; the output is plain decoding's."""
    from engine.cli import _plain_stretches

    ids = eng.tokenizer.encode("def add(a, b):")
    plain = eng.generate(ids, 80, ignore_eos=True)
    spec = eng.generate(ids, 80, ignore_eos=True, spec_len=4)
    extra = spec.timings.extra
    assert spec.ids == plain.ids
    assert extra["fallback"] and extra["fallbacks"] >= 2 and extra["plain_steps"] >= 32
    assert extra["plain_path"] == "eager"  # the CPU verifies eagerly, so plain steps are eager forwards
    line = _plain_stretches(extra)
    assert f"plain stretches {extra['fallbacks']}x ({extra['plain_steps']} tokens, eager)" in line
    assert _plain_stretches({"fallback": False}) == ""


def test_spec_fallback_zero_speculates_throughout_and_a_negative_one_is_refused(eng):
    ids = eng.tokenizer.encode("def add(a, b):")
    spec = eng.generate(ids, 40, ignore_eos=True, spec_len=4, spec_fallback=0)
    assert spec.ids == eng.generate(ids, 40, ignore_eos=True).ids
    assert not spec.timings.extra["fallback"] and spec.timings.extra["plain_steps"] <= 1
    with pytest.raises(ConfigError, match="spec_fallback must be >= 0 .* or 'auto'"):
        eng.generate(ids, 4, spec_len=4, spec_fallback=-1)


def test_auto_spec_fallback_through_the_engine(eng):
    """``spec_fallback="auto"`` opens with timed plain steps and keeps plain decoding's output."""
    from engine.dflash.speculative import CALIBRATION_STEPS

    ids = eng.tokenizer.encode("def add(a, b):")
    spec = eng.generate(ids, 40, ignore_eos=True, spec_len=4, spec_fallback="auto")
    assert spec.ids == eng.generate(ids, 40, ignore_eos=True).ids
    extra = spec.timings.extra
    assert extra["plain_steps"] >= CALIBRATION_STEPS and extra["plain_step_ms"] > 0 and extra["step_ms"] > 0
