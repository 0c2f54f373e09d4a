"""`luce-tune run/status/export/boot` end to end, with the real engine on the CPU."""

import shutil
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from tuner.cli import main
from tuner.config import default_config_path
from engine.profile import load_profile

pytestmark = pytest.mark.slow


def _embedded_default_on(tmp_path, tiny_gguf):
    """The embedded appliance.toml as shipped, with the shipped models when they exist and
    tiny random ones otherwise; the study and the profile go to tmp_path."""
    raw = tomllib.loads(default_config_path().read_text())
    repo = default_config_path().parent
    models = raw["models"]
    for key in ("target", "drafter"):
        if (repo / models[key]).exists():
            models[key] = str(repo / models[key])
        else:
            models[key] = str(shutil.copy(tiny_gguf, tmp_path / Path(models[key]).name))
    models["drafts"] = [str(repo / d) if (repo / d).exists()
                        else str(shutil.copy(tiny_gguf, tmp_path / Path(d).name))
                        for d in models["drafts"]]
    raw["study"]["storage"] = f"sqlite:///{tmp_path / 'study.db'}"
    raw["publish"]["profile"] = str(tmp_path / "profile.toml")
    path = tmp_path / "appliance.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def test_run_status_export_boot_on_the_embedded_default(tmp_path, tiny_gguf, capsys):
    config = _embedded_default_on(tmp_path, tiny_gguf)
    t0 = time.monotonic()
    assert main(["run", "--config", str(config)]) == 0
    assert time.monotonic() - t0 < 300  # the embedded default's promise on a CPU-only machine
    out = capsys.readouterr().out
    profile_path = tmp_path / "profile.toml"
    assert f"profile: {profile_path}" in out
    profile = load_profile(profile_path)
    assert profile.models["target"].size > 0 and profile.metrics["decode_tok_s"]["median"] > 0

    assert main(["status", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "Pareto front" in out and f"profile of trial #{profile.trial}" in out

    exported = tmp_path / "exported.toml"
    assert main(["export", "--config", str(config), "--trial", str(profile.trial), "--out", str(exported)]) == 0
    assert load_profile(exported).engine == profile.engine
    assert main(["export", "--config", str(config), "--trial", "99"]) == 2
    assert "trial 99 of study 'luce-tune' does not exist" in capsys.readouterr().err

    assert main(["boot", "--profile", str(profile_path), "--config", str(config)]) == 0
    captured = capsys.readouterr()
    assert "booted from" in captured.err and "smoke generation:" in captured.out

    text = profile_path.read_text()
    profile_path.write_text(text.replace("[engine]\n", "[engine]\nthreads = 64\n"))  # tampered
    assert main(["boot", "--profile", str(profile_path), "--config", str(config)]) == 0
    captured = capsys.readouterr()
    assert "not used, booted the safe default" in captured.err and "checksum" in captured.err
    assert "smoke generation:" in captured.out

    profile_path.write_text(text[: len(text) // 2])  # torn
    assert main(["boot", "--profile", str(profile_path), "--config", str(config)]) == 0
    assert "not used, booted the safe default" in capsys.readouterr().err


def test_bad_config_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "appliance.toml"
    bad.write_text(default_config_path().read_text().replace("spec_len = [2, 8]", "spec_len = [8, 2]"))
    assert main(["run", "--config", str(bad)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"error: {bad}: search.spec_len: expected") and err.endswith("found [8, 2]")
