"""bench/routing_reuse.py: the reuse counts on hand-made routing, and a run on a tiny quantized model with greedy
and random tokens fed."""

import json

from engine.gguf.make_model import make_model


def test_reuse_counts_shares_and_lru_hits(bench_script):
    reuse = bench_script("routing_reuse")
    steps = [{0: [1, 2], 1: [5, 6]}, {0: [1, 3], 1: [5, 6]}, {0: [4, 3], 1: [5, 6]}]
    r = reuse.reuse_of(steps, 2)
    assert r["previous_step_share"] == 0.75  # layer 0: 1/2 then 1/2; layer 1: 1 then 1
    assert (r["min_layer"], r["max_layer"]) == (0.5, 1.0)
    # 4 experts a layer hold everything: layer 0 hits 1 then 3 (2 of 6), layer 1 hits 4 of 6
    assert r["lru_hit_rate"][4] == 6 / 12


def test_a_run_reports_both_feeds(tmp_path, bench_script):
    reuse = bench_script("routing_reuse")
    model = make_model(tmp_path / "q8.gguf", "tiny", quant="q8_0", seed=1)
    out = tmp_path / "reuse.json"
    assert reuse.main(["--model", str(model), "--new-tokens", "6", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["feeds"]) == {"greedy", "random"}
    for r in report["feeds"].values():
        assert r["steps"] == 5 and 0.0 <= r["previous_step_share"] <= 1.0
        assert set(r["lru_hit_rate"]) == {"4", "8", "16", "32"}
    assert report["feeds"]["random"]["distinct_tokens"] >= 2
