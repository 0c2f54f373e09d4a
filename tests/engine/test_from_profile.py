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
