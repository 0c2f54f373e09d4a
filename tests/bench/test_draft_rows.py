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
    first = report["summary"]["first_slot"]
    assert first["slots"] == 2 * 12  # anchors from the prompt's last token to the row's last but one
    hit = first["hit"]
    assert all(0.0 <= v <= 1.0 for v in hit.values())
    count = {k: round(v * first["slots"]) for k, v in hit.items()}  # the rates are rounded: compare the counts
    either, draft, lookup = count["draft_or_row_lookup"], count["draft"], count["row_lookup"]
    assert max(draft, lookup) <= either <= draft + lookup
    assert abs(sum(b["share"] for b in first["by_target_p1"]) - 1.0) < 0.01
    assert sum(b["slots"] for b in report["summary"]["by_loop_period"]) == first["slots"]


def test_row_lookup_and_pair_followers(bench_script):
    draft_rows = bench_script("draft_rows")
    ids = [5, 6, 7, 1, 5, 6, 9, 2, 5, 6]
    assert draft_rows.row_lookup(ids, 9) == 9  # the latest earlier 5, 6 was followed by 9
    assert draft_rows.row_lookup(ids, 5) == 7
    assert draft_rows.row_lookup(ids, 2) is None

    class Chars:
        def encode(self, text):
            return [ord(c) for c in text]

    counts = draft_rows.follower_counts(Chars(), ["abcabd", "abc"])
    assert counts[(ord("a"), ord("b"))].most_common(1)[0] == (ord("c"), 2)
    slots = [{"p1": 0.99, "draft": True, "row_lookup": False, "pair_follower": True, "draft_or_row_lookup": True},
             {"p1": 0.10, "draft": False, "row_lookup": True, "pair_follower": False, "draft_or_row_lookup": True}]
    summary = draft_rows.first_slot_summary(slots)
    assert summary["hit"] == {"draft": 0.5, "pair_follower": 0.5, "row_lookup": 0.5, "draft_or_row_lookup": 1.0}
    assert summary["by_target_p1"] == [{"p1": "0-0.2", "share": 0.5, "draft_hit": 0.0},
                                       {"p1": "0.95-1", "share": 0.5, "draft_hit": 1.0}]


def test_loop_period_and_its_summary(bench_script):
    draft_rows = bench_script("draft_rows")
    loop = [9, 8] + [1, 2, 3] * 10
    assert draft_rows.loop_period(loop, len(loop) - 1, window=6) == 3
    assert draft_rows.loop_period(loop, 5, window=6) is None  # too few tokens before the window
    assert draft_rows.loop_period([7] * 20, 19, window=4) == 1
    assert draft_rows.loop_period(list(range(40)), 39, window=4) is None
    assert draft_rows.loop_period(loop, len(loop) - 1, window=6, longest=2) is None
    slots = [{"period": None, "copy": False, "draft": True, "accepted": 3},
             {"period": 3, "copy": True, "draft": False, "accepted": 1},
             {"period": 2, "copy": False, "draft": True, "accepted": 2},
             {"period": 40, "copy": True, "draft": True, "accepted": 5}]
    rows = {b["period"]: b for b in draft_rows.loop_summary(slots)}
    assert set(rows) == {"none", "1-4", "17-64"}
    assert rows["none"]["copy_hit"] is None and rows["none"]["share"] == 0.25
    assert rows["1-4"] == {"period": "1-4", "slots": 2, "share": 0.5, "copy_hit": 0.5, "draft_hit": 0.5,
                           "accepted": 1.5}
    assert rows["17-64"]["accepted"] == 5.0
