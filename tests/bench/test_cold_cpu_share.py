"""``bench/cold_cpu_share.py`` end to end on a tiny random model on the CPU: every row setting reaches the engine
and is recorded (a share, the fetch and warm counts, the route, the programs, the copier), every row decodes the
first row's greedy tokens, and a bad setting fails before any row with the engine's error."""

import json

import pytest

from bench.cold_cpu_share import main
from engine.errors import ConfigError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.gguf.make_model import make_model

    return make_model(tmp_path_factory.mktemp("share") / "tiny.gguf", "tiny", n_expert=16, quant="q4_0", seed=5)


def test_rows_take_every_setting(tiny, tmp_path, capsys):
    out = tmp_path / "rows.json"
    main(["--model", str(tiny), "--budget-mb", "0.05", "--shares", "0,0.5", "--threads", "2", "--new-tokens", "3",
          "--repeats", "1", "--prefetch", "1,2", "--warm", "1", "--routes", "side", "--fetch-programs", "4",
          "--fetch-copiers", "kernel,engine", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["share"], r["cold_prefetch"], r["fetch_copier"]) for r in rows] == [
        (0.0, 0, "kernel"), (0.5, 1, "kernel"), (0.5, 1, "engine"), (0.5, 2, "kernel"), (0.5, 2, "engine")]
    assert all(r["cold_warm"] == 1 and r["ahead_route"] == "side" and r["fetch_programs"] == 4 and r["threads"] == 2
               for r in rows[1:])
    assert all(r["same_tokens_as_first"] and r["decode_tok_s"]["median"] > 0 for r in rows)
    assert capsys.readouterr().out.count("tok/s") == 5


def test_a_bad_copier_fails_before_any_row(tiny, tmp_path):
    with pytest.raises(ConfigError, match="fetch's copier"):
        main(["--model", str(tiny), "--budget-mb", "0.05", "--shares", "0.5", "--threads", "1", "--new-tokens", "2",
              "--repeats", "1", "--prefetch", "1", "--fetch-copiers", "dma", "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_rows_per_build_report_chunks_fetched_ahead(tiny, tmp_path):
    out = tmp_path / "rows.json"
    main(["--model", str(tiny), "--budget-mb", "0.05", "--shares", "0.5", "--threads", "2", "--new-tokens", "4",
          "--repeats", "1", "--prefetch", "0", "--warm", "2", "--cflags", ";-DLT_SPEC=1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["cflags"] for r in rows] == ["", "-DLT_SPEC=1"]
    assert rows[0]["spec_chunks"] is None and rows[1]["spec_chunks"] >= 0
    assert all(r["warm_chunks"] >= 0 and r["same_tokens_as_first"] for r in rows)


def test_thread_phases_are_window_means():
    from bench.cold_cpu_share import thread_phases

    before = {"jobs": 10, "job_us": 50.0, "threads": [[20.0, 5.0, 10.0], [30.0, 1.0, 12.0]]}
    after = {"jobs": 20, "job_us": 60.0, "threads": [[25.0, 5.0, 10.0], [30.0, 3.0, 16.0]]}
    got = thread_phases(before, after)  # the window's means: thread 0 (30, 5, 10), thread 1 (30, 5, 20)
    assert got == {"gate_up": {"mean": 30.0, "max": 30.0}, "wait": {"mean": 5.0, "max": 5.0},
                   "down": {"mean": 15.0, "max": 20.0}}
    assert thread_phases(after, after) is None and thread_phases(None, after) is None
