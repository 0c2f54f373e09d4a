"""bench/side_by_sides.py: every recorded side by side's half-cold decode in one table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _side_by_side(path: Path, ours_half: list[float], llama_half: list[float], *, share: float = 0.45,
                  machine: str = "NVIDIA H100 80GB HBM3", date: str = "2026-12-07T10:00:00+00:00") -> None:
    def row(name, ncmoe, ours, llama, vram):
        return {"name": name, "n_prompt": 0, "n_gen": 64, "depth": 0, "ncmoe": ncmoe,
                "ours": {"samples_ts": ours, "peak_vram_mib": vram},
                "llama": {"samples_ts": llama, "median_ts": sorted(llama)[len(llama) // 2],
                          "peak_vram_mib": vram + 300}}
    rows = [{"name": "pp512", "n_prompt": 512, "n_gen": 0, "depth": 0, "ncmoe": 0,
             "ours": {"samples_ts": [9000.0]}, "llama": {"samples_ts": [5000.0], "median_ts": 5000.0}},
            row("tg64@d0", 0, [520.0, 522.0, 521.0], [240.0, 250.0, 260.0], 18835),
            row("tg64@d0 ncmoe20", 20, ours_half, llama_half, 10258)]
    ncmoe = {"placement_unit": "alternate", "cold_cpu_share": share, "cold_prefetch": 2, "cold_warm": 4,
             "fetch_copier": "kernel"}
    path.write_text(json.dumps({"date": date, "machine": machine, "rows": rows, "ours": {"ncmoe": ncmoe}}))


def test_the_report_gathers_half_cold_runs_and_their_correlation(tmp_path, bench_script):
    sbs = bench_script("side_by_sides")
    _side_by_side(tmp_path / "vs_llamacpp_a.json", [200.0, 210.0, 220.0], [100.0, 100.0, 100.0])
    _side_by_side(tmp_path / "vs_llamacpp_b.json", [205.0, 210.0, 215.0], [80.0, 84.0, 82.0],
                  date="2026-12-06T10:00:00+00:00")
    _side_by_side(tmp_path / "vs_llamacpp_c.json", [212.0], [120.0], machine="NVIDIA H200")
    _side_by_side(tmp_path / "vs_llamacpp_d.json", [300.0], [100.0], share=0.6)  # other settings: listed only
    (tmp_path / "vs_llamacpp_broken.json").write_text(json.dumps({"rows": "nope"}))
    (tmp_path / "other.json").write_text("{}")  # not a side by side's name: not read
    runs, skipped = sbs.read_runs(tmp_path)
    assert [r.file for r in runs] == ["vs_llamacpp_b.json", "vs_llamacpp_a.json", "vs_llamacpp_c.json",
                                      "vs_llamacpp_d.json"]  # by date, then name
    assert skipped == ["vs_llamacpp_broken.json: no 'rows' list"]
    a = runs[1]
    assert (a.ours, a.llama, a.ratio) == (210.0, 100.0, 2.1)
    assert a.gpu_ratio == pytest.approx(521.0 / 250.0) and (a.vram_ours, a.vram_llama) == (10258, 10558)
    current = {"placement_unit": "alternate", "cold_cpu_share": 0.45, "cold_prefetch": 2, "cold_warm": 4}
    text = sbs.report(runs, current, skipped)
    assert text.count("| 2026-12-0") == 4 and "| H200 |" in text
    assert "Runs with placement_unit alternate, cold_cpu_share 0.45, cold_prefetch 2, cold_warm 4: 3." in text
    assert "ratio: median 2.10 (1.77-2.56); 1 of 3 at 2.5x or more" in text
    llama, ratios = [82.0, 100.0, 120.0], [210.0 / 82.0, 2.1, 212.0 / 120.0]
    assert f"the ratio's {sbs.correlation(llama, ratios):.2f}" in text
    assert sbs.correlation(llama, ratios) < -0.9  # ours steady, llama.cpp's speed sets the ratio
    assert "vs_llamacpp_broken.json: no 'rows' list" in text
    assert sbs.correlation([1.0, 2.0], [1.0, 2.0]) is None and sbs.correlation([1.0, 1.0, 1.0], [1, 2, 3]) is None


def test_the_cli_writes_the_report_and_refuses_an_empty_folder(tmp_path):
    _side_by_side(tmp_path / "vs_llamacpp_a.json", [200.0], [100.0])
    out = tmp_path / "report.md"
    script = str(ROOT / "bench" / "side_by_sides.py")
    proc = subprocess.run([sys.executable, script, "--dir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == proc.stdout and "| 2.00 |" in proc.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([sys.executable, script, "--dir", str(empty)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no side by side" in proc.stderr
    proc = subprocess.run([sys.executable, script, "--dir", str(tmp_path / "nope")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "is not a folder" in proc.stderr
