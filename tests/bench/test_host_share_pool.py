"""bench/host_share_pool.py: the pool alone, with each job run twice (``--again``) beside the plain row."""

import json
import sys

import torch

from engine.kernels.host_experts import REPLY_HEADER


def test_again_times_the_second_of_two_identical_jobs(tmp_path, bench_script, monkeypatch):
    pool = bench_script("host_share_pool")
    published, collected = [], []
    publish, collect = pool.HostShare.publish, pool.HostShare.collect

    def spy_publish(self, layer, x, ids, weights, mine):
        published.append((layer, ids.clone()))
        return publish(self, layer, x, ids, weights, mine)

    def spy_collect(self, out):  # the threads' sum itself (collect adds it into ``out``)
        r = collect(self, out)
        collected.append(self.reply.view(torch.float32)[REPLY_HEADER:REPLY_HEADER + self.hidden].clone())
        return r

    monkeypatch.setattr(pool.HostShare, "publish", spy_publish)
    monkeypatch.setattr(pool.HostShare, "collect", spy_collect)
    out = tmp_path / "pool.json"
    monkeypatch.setattr(sys, "argv", ["host_share_pool.py", "--threads", "1", "--pairs", "2", "--jobs", "3",
                                      "--layers", "2", "--again", "--cflags", "-DLT_STATS=1",
                                      "--activations", "int8", "--json", str(out)])
    pool.main()
    jobs = 20 + 3
    assert len(published) == jobs + 2 * jobs  # the plain row once a job, the "again" row twice
    twice = published[jobs:]
    for (layer_a, ids_a), (layer_b, ids_b) in zip(twice[::2], twice[1::2]):
        assert layer_a == layer_b and torch.equal(ids_a, ids_b)
        assert (ids_a[0] >= 0).sum() == 2
    sums = collected[jobs:]
    for a, b in zip(sums[::2], sums[1::2]):
        assert torch.equal(a, b) and a.abs().sum() > 0  # the same job gives the same bits the second time
    rows = json.loads(out.read_text())["rows"]
    assert [(r["pairs"], r["warmed"], r["again"]) for r in rows] == [(2, False, False), (2, False, True)]
    for r in rows:
        assert r["job_us"] > 0 and r["pool_us"] > 0
        assert r["gate_up_us"] > 0 and r["down_us"] > 0 and r["pool_us"] >= r["gate_up_us"]


def test_a_flag_value_after_its_option_is_joined_to_it(bench_script):
    common = bench_script("common")
    argv = ["--threads", "1", "--cflags", "-DLT_STATS=1 -DLT_WARM_LOAD=0", "--pairs", "2", "--cflags=-DX", "--cflags"]
    assert common.joined_values(argv, ("--cflags",)) == [
        "--threads", "1", "--cflags=-DLT_STATS=1 -DLT_WARM_LOAD=0", "--pairs", "2", "--cflags=-DX", "--cflags"]
    assert common.joined_values(["--cflags", ";-DLT_SPEC=1"], ("--cflags",)) == ["--cflags=;-DLT_SPEC=1"]
    assert common.joined_values(["--threads", "-1"], ("--cflags",)) == ["--threads", "-1"]
