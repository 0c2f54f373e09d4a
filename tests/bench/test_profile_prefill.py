"""bench/profile_prefill.py: the line through the timings, and one run on a tiny model on the CPU."""

import json
import sys

import pytest


def test_fit_line_recovers_a_line(bench_script):
    fit_line = bench_script("profile_prefill").fit_line
    a, b = fit_line([128.0, 512.0, 2048.0], [10.0 + 0.5 * x for x in (128, 512, 2048)])
    assert a == pytest.approx(10.0) and b == pytest.approx(0.5)
    assert fit_line([100.0], [50.0]) == (0.0, 0.5)


def test_times_each_setting_and_profiles(bench_script, tmp_path, monkeypatch, capsys):
    from engine.gguf.make_model import make_model

    model = make_model(tmp_path / "tiny.gguf", "tiny", seed=1, n_layers=4)
    out = tmp_path / "prefill.json"
    monkeypatch.setattr(sys, "argv", ["profile_prefill.py", "--model", str(model), "--weights", "dense",
                                      "--experts", "dense", "--lens", "8,24", "--repeats", "2",
                                      "--profile-len", "8", "--rows", "5", "--dequant-min-m", "256,0",
                                      "--json", str(out)])
    bench_script("profile_prefill").main()
    result = json.loads(out.read_text())
    assert set(result["settings"]) == {"256", "0"}
    for timed in result["settings"].values():
        assert set(timed["lens"]) == {"8", "24"} and all(v["wall_ms"]["n"] == 2 for v in timed["lens"].values())
        assert "fixed_ms" in timed["fit"]
    assert result["profile"]["len"] == 8 and result["profile"]["host_self_ms"] > 0
    printed = capsys.readouterr().out
    assert "fit:" in printed and "by host time" in printed
    with pytest.raises(SystemExit):
        monkeypatch.setattr(sys, "argv", ["profile_prefill.py", "--model", str(model), "--lens", "x"])
        bench_script("profile_prefill").main()
