"""bench/draft_rows.py on the shipped target and draft: per-row acceptance, teacher-forced and
speculative, on windows of a small corpus."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rows_report_both_acceptances_within_a_block(tmp_path, bench_script):
    draft_rows = bench_script("draft_rows")
    sources = sorted((ROOT / "engine" / "dflash").glob("*.py"))[:6]
    corpus = tmp_path / "train.txt"
    corpus.write_text("".join(p.read_text() + "<|endoftext|>" for p in sources))
    out = tmp_path / "rows.json"
    assert draft_rows.main(["--draft", str(ROOT / "models" / "luce-draft.gguf"), "--target",
                            str(ROOT / "models" / "luce-target.gguf"), "--corpus", str(corpus), "--rows", "2",
                            "--prompt", "24", "--new", "12", "--speculative", "--device", "cpu",
                            "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["summary"]["rows"] == 2 and len(report["rows"]) == 2
    for row in report["rows"]:
        for key in ("teacher_forced", "speculative"):
            assert 1.0 <= row[key] <= 16.0
        assert 1 <= row["distinct_new"] <= 12
    tf = [r["teacher_forced"] for r in report["rows"]]
    assert abs(report["summary"]["mean"] - sum(tf) / 2) < 1e-3
