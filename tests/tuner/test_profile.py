import os

import pytest

from engine.profile import (
    Profile,
    ProfileError,
    load_profile,
    model_entry,
    model_hashes,
    verify_profile,
    write_profile,
)

FINGERPRINT = {"gpu_name": "", "gpu_uuid": "", "gpu_driver": "", "gpu_vram_mb": 0,
               "cpu": "test cpu", "cpu_count": 2, "ram_mb": 24000}


@pytest.fixture
def profile(tmp_path):
    target = tmp_path / "target.gguf"
    target.write_bytes(os.urandom(3000))
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(os.urandom(1000))
    return Profile(
        study="s", trial=3, created="2026-01-01T00:00:00+00:00", luce_tune_version="0.1.0",
        engine={"device": "cpu", "spec_len": 4, "expert_budget_mb": 2048},
        models={"target": model_entry(target), "draft": model_entry(draft)},
        hardware=dict(FINGERPRINT),
        metrics={"decode_tok_s": {"median": 41.25, "low": 40.0, "high": 43.5, "n": 3}})


def test_round_trip_and_engine_options(tmp_path, profile):
    path = tmp_path / "out" / "profile.toml"
    write_profile(path, profile)
    assert load_profile(path) == profile
    assert [p.name for p in path.parent.iterdir()] == ["profile.toml"]  # no temporary left
    assert profile.load_options() == {"device": "cpu", "expert_budget_mb": 2048,
                                      "draft": profile.models["draft"].path}
    assert profile.generate_options() == {"spec_len": 4}


def test_spec_lookup_round_trips_into_the_generate_options(tmp_path, profile):
    """A profile's lookup match length is a generate() option beside spec_len; one without the key (older
    profiles) leaves the engine's default, off."""
    from dataclasses import replace

    path = tmp_path / "p.toml"
    write_profile(path, replace(profile, engine=dict(profile.engine, spec_lookup=3)))
    loaded = load_profile(path)
    assert loaded.engine["spec_lookup"] == 3
    assert loaded.generate_options() == {"spec_len": 4, "spec_lookup": 3}
    assert "spec_lookup" not in loaded.load_options()
    write_profile(path, profile)
    assert "spec_lookup" not in load_profile(path).generate_options()


def _checksummed(path, content):
    """Write ``content`` as a profile with a matching checksum, past Profile's own validation."""
    import tomli_w

    from engine.profile import checksum

    content["profile"]["checksum"] = checksum(content)
    path.write_text(tomli_w.dumps(content))


@pytest.mark.parametrize("value, message", [
    (17, r"engine\.spec_lookup: expected a match length from 0 \(off\) to 16, found 17$"),
    (-1, r"engine\.spec_lookup: expected .*, found -1$"),
    ("3", r"engine\.spec_lookup: expected .*, found '3'$"),
    (2.0, r"engine\.spec_lookup: expected .*, found 2\.0$"),
    (True, r"engine\.spec_lookup: expected .*, found True$"),
])
def test_a_bad_spec_lookup_is_refused(tmp_path, profile, value, message):
    from dataclasses import replace

    with pytest.raises(ValueError, match=message):
        replace(profile, engine=dict(profile.engine, spec_lookup=value))
    path = tmp_path / "p.toml"
    content = profile.content()
    content["engine"]["spec_lookup"] = value
    _checksummed(path, content)
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def test_spec_lookup_without_a_draft_is_refused(tmp_path, profile):
    from dataclasses import replace

    message = r"engine\.spec_lookup 3 is set without a draft \(models\.draft\)$"
    with pytest.raises(ValueError, match=message):
        replace(profile, engine=dict(profile.engine, spec_lookup=3), models={"target": profile.models["target"]})
    content = profile.content()
    content["engine"]["spec_lookup"] = 3
    del content["models"]["draft"]
    path = tmp_path / "p.toml"
    _checksummed(path, content)
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


def test_verify_accepts_the_same_machine_and_files(profile):
    assert verify_profile(profile, FINGERPRINT, model_hashes(profile)) == []


def test_verify_names_each_mismatch(profile):
    other = dict(FINGERPRINT, gpu_uuid="GPU-2", ram_mb=12000)
    with open(profile.models["draft"].path, "r+b") as f:  # same size, other bytes
        f.write(b"X" * 10)
    problems = verify_profile(profile, other, model_hashes(profile))
    assert any(p.startswith("hardware.gpu_uuid is 'GPU-2' here") for p in problems)
    assert any(p.startswith("hardware.ram_mb is 12000 here") for p in problems)
    assert any(p.startswith("models.draft:") and "sha256" in p for p in problems)
    assert len(problems) == 3
    os.remove(profile.models["target"].path)
    assert any("models.target:" in p and "missing" in p
               for p in verify_profile(profile, FINGERPRINT, model_hashes(profile)))


def test_torn_and_tampered_profiles_are_refused(tmp_path, profile):
    path = tmp_path / "profile.toml"
    text = write_profile(path, profile)
    path.write_text(text[: len(text) * 2 // 3])  # torn mid-write
    with pytest.raises(ProfileError, match=str(path)):
        load_profile(path)
    path.write_text(text.replace("spec_len = 4", "spec_len = 7"))
    with pytest.raises(ProfileError, match="checksum .* does not match the content"):
        load_profile(path)
    path.write_text("\n".join(l for l in text.splitlines() if not l.startswith("checksum")))
    with pytest.raises(ProfileError, match="checksum is missing"):
        load_profile(path)
    with pytest.raises(ProfileError, match="profile not found"):
        load_profile(tmp_path / "none.toml")


def test_engine_formats_and_graph_travel_to_the_load(tmp_path, profile):
    """The config's [engine] settings and the searched CPU share are load options of the published profile."""
    from dataclasses import replace

    p = replace(profile, engine=dict(profile.engine, weights="quantized", cold_format="quantized",
                                     hot_format="quantized", cuda_graph=True, cold_device="gpu",
                                     cold_cpu_share=0.45))
    path = tmp_path / "p.toml"
    write_profile(path, p)
    loaded = load_profile(path)
    assert loaded.load_options() == {"device": "cpu", "expert_budget_mb": 2048, "weights": "quantized",
                                     "cold_format": "quantized", "hot_format": "quantized", "cuda_graph": True,
                                     "cold_device": "gpu", "cold_cpu_share": 0.45,
                                     "draft": profile.models["draft"].path}


def test_the_version_falls_back_to_the_source_tree(monkeypatch):
    from importlib import metadata

    from tuner import publish

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(publish.metadata, "version", missing)
    import tomllib
    from pathlib import Path

    expected = tomllib.loads((Path(publish.__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert publish.luce_tune_version() == expected["project"]["version"] + "+source"


def test_the_searched_cpu_share_is_published(tmp_path):
    """A winner's CPU share of the cold experts lands in the profile's engine settings beside the config's
    [engine] ones, and is a load option at boot."""
    from tuner.config import load_config
    from tuner.publish import build_profile
    from tuner.space import TrialParams

    target = tmp_path / "t.gguf"
    target.write_bytes(os.urandom(100))
    (tmp_path / "appliance.toml").write_text('[models]\ntarget = "t.gguf"\ndrafts = []\ndrafter = ""\n'
                                             '[engine]\nexperts = "quantized"\ncold_device = "gpu"\n'
                                             '[study]\ntrials = 2\n[publish]\nprofile = "p.toml"\n')
    cfg = load_config(tmp_path / "appliance.toml")
    files = {"target": {"path": str(target), "size": 100, "sha256": "0" * 64}}
    p = build_profile(cfg, files, 2, TrialParams(expert_budget_mb=1024, cold_cpu_share=0.45), {}, "cuda",
                      FINGERPRINT)
    assert p.engine["cold_cpu_share"] == 0.45 and p.engine["cold_device"] == "gpu"
    assert p.load_options()["cold_cpu_share"] == 0.45 and p.load_options()["expert_budget_mb"] == 1024
    bare = build_profile(cfg, files, 2, TrialParams(expert_budget_mb=1024), {}, "cuda", FINGERPRINT)
    assert "cold_cpu_share" not in bare.engine and "placement_unit" not in bare.engine
    ahead = build_profile(cfg, files, 2, TrialParams(expert_budget_mb=1024, cold_cpu_share=0.5, cold_prefetch=2,
                                                     cold_warm=1), {}, "cuda", FINGERPRINT)
    assert (ahead.engine["cold_prefetch"], ahead.engine["cold_warm"]) == (2, 1)
    assert ahead.load_options()["cold_prefetch"] == 2 and ahead.load_options()["cold_warm"] == 1
    assert "cold_prefetch" not in bare.engine
    by_layer = build_profile(cfg, files, 2, TrialParams(expert_budget_mb=1024, placement_unit="layer"), {}, "cuda",
                             FINGERPRINT)
    assert by_layer.engine["placement_unit"] == "layer" and by_layer.load_options()["placement_unit"] == "layer"


def test_the_searched_lookup_is_published_only_with_a_draft(tmp_path):
    """A winner's lookup match length lands in the profile's engine settings beside spec_len, with the draft's
    file, and becomes a generate() option at boot; a winner without a draft (or a study without the lookup)
    publishes none."""
    from tuner.config import load_config
    from tuner.publish import build_profile
    from tuner.space import TrialParams

    files = {}
    for name in ("t.gguf", "d.gguf"):
        (tmp_path / name).write_bytes(os.urandom(100))
        files[name] = {"path": str(tmp_path / name), "size": 100, "sha256": "0" * 64}
    (tmp_path / "appliance.toml").write_text('[models]\ntarget = "t.gguf"\ndrafts = ["d.gguf"]\ndrafter = ""\n'
                                             '[search]\nspec_lookup = [0, 3]\n'
                                             '[study]\ntrials = 2\n[publish]\nprofile = "p.toml"\n')
    cfg = load_config(tmp_path / "appliance.toml")
    files = {"target": files["t.gguf"], "draft:d.gguf": files["d.gguf"]}
    p = build_profile(cfg, files, 2, TrialParams(draft="d.gguf", spec_len=4, spec_lookup=3), {}, "cpu",
                      FINGERPRINT)
    assert p.engine["spec_lookup"] == 3 and p.models["draft"].path == str(tmp_path / "d.gguf")
    assert p.generate_options() == {"spec_len": 4, "spec_lookup": 3}
    off = build_profile(cfg, files, 2, TrialParams(draft="d.gguf", spec_len=4, spec_lookup=0), {}, "cpu",
                        FINGERPRINT)
    assert off.generate_options() == {"spec_len": 4, "spec_lookup": 0}
    for params in (TrialParams(), TrialParams(draft="d.gguf", spec_len=4)):
        assert "spec_lookup" not in build_profile(cfg, files, 2, params, {}, "cpu", FINGERPRINT).engine
