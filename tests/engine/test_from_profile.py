"""Engine.from_profile: boot with a verified profile's settings, or fall back with a warning."""

import pytest

from engine.engine import Engine
from engine.gguf.make_model import make_model
from engine.hardware import detect_hardware
from engine.profile import Profile, ProfileError, model_entry, write_profile


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("profile") / "tiny.gguf", "tiny", seed=1)


def here() -> dict:
    return detect_hardware(None, "cpu", torch_cuda=False).fingerprint.as_dict()


def profile_for(target, **hardware) -> Profile:
    return Profile(study="s", trial=1, created="2026-11-30T00:00:00+00:00", luce_tune_version="0.1.0",
                   engine={"device": "cpu", "threads": 1}, models={"target": model_entry(target)},
                   hardware={**here(), **hardware}, metrics={})


def test_a_matching_profile_boots_with_its_settings(tmp_path, target):
    path = tmp_path / "profile.toml"
    write_profile(path, profile_for(target))
    eng = Engine.from_profile(path)
    assert eng.path == target and eng.device.type == "cpu"
    assert len(eng.generate(eng.tokenizer.encode("x"), 3, ignore_eos=True).ids) == 3


def test_another_machine_falls_back_with_a_warning(tmp_path, target):
    path = tmp_path / "profile.toml"
    write_profile(path, profile_for(target, cpu="another cpu", ram_mb=1))
    with pytest.warns(UserWarning, match="hardware.cpu is 'another cpu'|hardware.cpu"):
        eng = Engine.from_profile(path, device="cpu")
    assert eng.path == target and eng.defaults == {}


def test_a_torn_profile_needs_a_fallback_target(tmp_path, target):
    path = tmp_path / "profile.toml"
    write_profile(path, profile_for(target))
    path.write_text(path.read_text()[:-40])
    with pytest.raises(ProfileError, match="no fallback target"):
        Engine.from_profile(path)
    with pytest.warns(UserWarning, match="not used"):
        eng = Engine.from_profile(path, fallback_target=target, device="cpu")
    assert eng.path == target


@pytest.fixture(scope="module")
def draft(tmp_path_factory, target):
    import torch

    from engine.dflash.draft import DFlashDraft, DraftConfig
    from engine.dflash.gguf_io import write_draft_gguf

    eng = Engine.from_gguf(target, device="cpu")
    cfg = DraftConfig(n_layers=2, hidden=eng.config.hidden, ffn=96, n_head=4, n_head_kv=2, head_dim=16,
                      rms_eps=1e-6, rope_theta=1e7, block_size=8, mask_token_id=eng.config.vocab - 1,
                      target_layer_ids=(0, 2), vocab=eng.config.vocab)
    return write_draft_gguf(DFlashDraft(cfg).init_random(torch.Generator().manual_seed(0)),
                            tmp_path_factory.mktemp("draft") / "draft.gguf", qtype="f32")


def test_the_profile_spec_lookup_is_the_engine_default(tmp_path, target, draft):
    """A profile's spec_len and lookup match length become generate()'s defaults: speculation with the
    lookup on, the output still plain decoding's."""
    from dataclasses import replace

    path = tmp_path / "profile.toml"
    write_profile(path, replace(profile_for(target), engine={"device": "cpu", "threads": 1, "spec_len": 4,
                                                             "spec_lookup": 3},
                                models={"target": model_entry(target), "draft": model_entry(draft)}))
    eng = Engine.from_profile(path)
    assert eng.draft is not None and eng.defaults == {"spec_len": 4, "spec_lookup": 3}
    ids = eng.tokenizer.encode("def f(x):\n    return x\ndef f(x):\n    return x\n")
    gen = eng.generate(ids, 12, ignore_eos=True)
    assert gen.timings.extra["lookup"] == 3 and gen.timings.extra["spec_len"] == 4
    assert eng.generate(ids, 12, ignore_eos=True, spec_lookup=0).timings.extra["lookup"] == 0
    plain = Engine.from_gguf(target, device="cpu", threads=1).generate(ids, 12, ignore_eos=True)
    assert gen.ids == plain.ids


def test_a_bad_spec_lookup_in_the_profile_is_refused(tmp_path, target):
    """A profile naming the lookup without a draft is refused with one sentence naming engine.spec_lookup."""
    import tomli_w

    from engine.profile import checksum

    content = profile_for(target).content()
    content["engine"]["spec_lookup"] = 3
    content["profile"]["checksum"] = checksum(content)
    path = tmp_path / "profile.toml"
    path.write_text(tomli_w.dumps(content))
    with pytest.raises(ProfileError, match=r"engine\.spec_lookup 3 is set without a draft"):
        Engine.from_profile(path)
    with pytest.warns(UserWarning, match=r"engine\.spec_lookup 3 is set without a draft"):
        eng = Engine.from_profile(path, fallback_target=target, device="cpu")
    assert eng.defaults == {}
