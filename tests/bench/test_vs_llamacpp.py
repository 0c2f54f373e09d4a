"""bench/vs_llamacpp.py and its helpers, without building llama.cpp or using a GPU.

fixtures/llama_bench_cpu_recorded.json is real output: llama-bench built from the
llama-cpp-python 0.3.36 sdist (llama.cpp 0c1e570), CPU-only, on models/luce-target.gguf with
``-p 0 -n 4 -d 8 -r 2 -fa on -o json``. fixtures/llama_bench_qwen35moe.json is an H200-style
sample written after llama-bench's ``json_printer`` (same fields, order and typing as the
recorded file); its numbers are illustrative but consistent (``samples_ts = 1e9 * tokens / samples_ns``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench import llamacpp
from bench.decode_floor import active_bytes, copy_bandwidth
from bench.llamacpp import (BenchFeatures, BenchTest, BuildPlan, LlamaCppError, bench_command, build_llama_bench,
                            llama_source, parse_bench_json, parse_help, plan_build, probe_features)
from engine.gguf.make_model import make_model
from engine.gguf.reader import GGUFFile
from engine.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "llama_bench_qwen35moe.json"

NEW_HELP = """usage: llama-bench [options]
  -o, --output <csv|json|jsonl|md|sql>        output format printed to stdout (default: md)
  -p, --n-prompt <n>                                (default: 512)
  -n, --n-gen <n>                                   (default: 128)
  -d, --n-depth <n>                                 (default: 0)
  -ngl, --n-gpu-layers <n>                          (default: 99)
  -ncmoe, --n-cpu-moe <n>                           (default: 0)
  -fa, --flash-attn <on|off|auto>                   (default: auto)
"""
OLD_HELP = """usage: llama-bench [options]
  -o, --output <csv|json|jsonl|md|sql>      (default: md)
  -p, --n-prompt <n>                        (default: 512)
  -n, --n-gen <n>                           (default: 128)
  -ngl, --n-gpu-layers <n>                  (default: 99)
  -fa, --flash-attn <0|1>                   (default: 0)
"""


def test_parse_recorded_sample():
    records = parse_bench_json(FIXTURE.read_text(), str(FIXTURE))
    assert [(r.n_prompt, r.n_gen, r.n_depth, r.n_cpu_moe) for r in records] == [
        (512, 0, 0, 0), (0, 128, 16384, 0), (0, 128, 0, 30)]
    pp, tg, moe = records
    assert pp.median_ts == 5877.02 and pp.samples_ts == (5877.02, 5916.87, 5817.89)
    assert pp.avg_ts == pytest.approx(5870.594546) and pp.stddev_ts == pytest.approx(49.802998)
    assert tg.median_ts == 157.549 and moe.median_ts == 44.5697
    assert pp.flash_attn == 1 and pp.n_gpu_layers == 99 and pp.backends == "CUDA"
    assert pp.model_type.startswith("qwen35moe") and pp.model_size == 22016983040
    for r in records:  # the fixture is self-consistent: rates from the nanosecond samples
        assert r.avg_ts == pytest.approx(sum(r.samples_ts) / len(r.samples_ts), rel=1e-4)
    assert json.loads(json.dumps(tg.as_dict()))["median_ts"] == tg.median_ts


def test_parse_output_recorded_on_this_cpu():
    path = FIXTURE.with_name("llama_bench_cpu_recorded.json")
    (r,) = parse_bench_json(path.read_text(), str(path))
    assert (r.n_prompt, r.n_gen, r.n_depth, r.n_cpu_moe, r.flash_attn) == (0, 4, 8, 0, 1)
    assert r.backends == "CPU" and r.build_commit == "0c1e570" and r.model_type.startswith("qwen35moe")
    assert len(r.samples_ts) == 2 and r.median_ts == pytest.approx(sum(r.samples_ts) / 2)
    assert r.median_ts == pytest.approx(r.avg_ts, rel=1e-5)
    assert list(json.loads(path.read_text())[0]) == list(json.loads(FIXTURE.read_text())[0])


def test_parse_older_format_and_log_noise():
    old = [{"n_prompt": 0, "n_gen": 64, "flash_attn": True, "avg_ts": 10.0, "stddev_ts": 0.5,
            "samples_ts": [9.0, 10.0, 11.0, 12.0]}]
    (r,) = parse_bench_json("ggml_cuda_init: found 1 CUDA devices\n" + json.dumps(old))
    assert (r.n_depth, r.n_cpu_moe, r.flash_attn) == (0, 0, 1)
    assert r.median_ts == 10.5  # even count: mean of the middle two
    (r,) = parse_bench_json(json.dumps([{"n_prompt": 8, "n_gen": 0, "avg_ts": 3.0, "stddev_ts": 0.0}]))
    assert r.median_ts == 3.0  # no samples: the average


@pytest.mark.parametrize("text, match", [
    ("no json here", "no JSON array"),
    ("[{\"n_prompt\": 1,", "not valid JSON"),
    ("[{\"n_prompt\": 1, \"n_gen\": 0}]", "lacks avg_ts, stddev_ts"),
])
def test_parse_errors(text, match):
    with pytest.raises(LlamaCppError, match=match):
        parse_bench_json(text)


def test_parse_help_new_and_old():
    assert parse_help(NEW_HELP) == BenchFeatures(depth=True, ncmoe=True, fa_on="on")
    assert parse_help(OLD_HELP) == BenchFeatures(depth=False, ncmoe=False, fa_on="1")
    with pytest.raises(LlamaCppError, match="does not look like llama-bench"):
        parse_help("usage: something else --help")


def test_bench_command():
    new, old = parse_help(NEW_HELP), parse_help(OLD_HELP)
    b, m = Path("/opt/llama-bench"), Path("m.gguf")
    cmd = bench_command(b, m, BenchTest("tg", 0, 128, 16384, 30), new, n_gpu_layers=99, repeats=5, threads=8)
    assert cmd[:2] == ["/opt/llama-bench", "-m"]
    pairs = dict(zip(cmd[1::2], cmd[2::2]))
    assert pairs == {"-m": "m.gguf", "-p": "0", "-n": "128", "-ngl": "99", "-fa": "on", "-r": "5", "-o": "json",
                     "-d": "16384", "-ncmoe": "30", "-t": "8"}
    cmd = bench_command(b, m, BenchTest("pp", 512, 0), old, n_gpu_layers=0, repeats=1)
    assert "-d" not in cmd and "-ncmoe" not in cmd and cmd[cmd.index("-fa") + 1] == "1"
    with pytest.raises(LlamaCppError, match="no -d/--n-depth"):
        bench_command(b, m, BenchTest("tg", 0, 16, 512), old, n_gpu_layers=99, repeats=1)
    with pytest.raises(LlamaCppError, match="no -ncmoe"):
        bench_command(b, m, BenchTest("pp", 16, 0, 0, 4), old, n_gpu_layers=99, repeats=1)
    with pytest.raises(ValueError, match="exactly one of n_prompt"):
        BenchTest("both", 16, 16)


def _expected_expert_bytes(cfg: ModelConfig, bytes_per_weight: int) -> int:
    return 3 * cfg.expert_ffn * cfg.hidden * bytes_per_weight  # gate, up, down of one expert


@pytest.mark.parametrize("fused", [False, True])
def test_active_bytes_tiny_model(tmp_path, fused):
    path = make_model(tmp_path / "tiny.gguf", "tiny", quant="q8_0", expert_quant="f16", seed=1, fused_experts=fused)
    with GGUFFile(path) as f:
        cfg = ModelConfig.from_metadata(f.metadata)
        total = sum(t.nbytes for t in f.tensors.values())
        embd = f.tensors["token_embd.weight"]
    one_expert = _expected_expert_bytes(cfg, 2)
    all_experts = cfg.n_layers * cfg.n_expert * one_expert
    a = active_bytes(path)
    assert a.expert_layer_bytes == (cfg.n_expert * one_expert,) * cfg.n_layers
    assert a.experts_active == cfg.n_layers * cfg.n_expert_used * one_expert
    assert a.embedding_row == embd.nbytes // cfg.vocab == 34 * cfg.hidden // 32  # one q8_0 row
    assert a.non_expert == total - all_experts - embd.nbytes
    assert a.per_token == a.non_expert + a.embedding_row + a.experts_active
    assert a.floor_tok_s(1e9) == pytest.approx(1e9 / a.per_token)


def test_active_bytes_skip_the_mtp_block(tmp_path):
    plain = active_bytes(make_model(tmp_path / "plain.gguf", "tiny", seed=2))
    mtp = active_bytes(make_model(tmp_path / "mtp.gguf", "tiny", seed=2, mtp=True))
    assert mtp == plain


def test_copy_bandwidth_cpu():
    import torch

    bw = copy_bandwidth(torch.device("cpu"), 4 << 20, repeats=2)
    assert math.isfinite(bw) and bw > 1e7
    with pytest.raises(ValueError, match="must be positive"):
        copy_bandwidth(torch.device("cpu"), 0)


def test_cmake_command_lines(tmp_path):
    src, build = tmp_path / "llama.cpp", tmp_path / "build"
    cuda = BuildPlan(source=src, build_dir=build, jobs=16, nvcc="/usr/local/cuda/bin/nvcc", cuda_arch="90",
                     generator="Ninja")
    cmd = cuda.configure_cmd()
    assert cmd[:3] == ["cmake", "-G", "Ninja"] and cmd[cmd.index("-S") + 1] == str(src)
    assert cmd[cmd.index("-B") + 1] == str(build / "cmake")
    for flag in ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc",
                 "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF"):
        assert flag in cmd
    assert cuda.build_cmd() == ["cmake", "--build", str(build / "cmake"), "--config", "Release",
                                "--target", "llama-bench", "-j", "16"]
    assert cuda.binary == build / "cmake" / "bin" / "llama-bench"
    cpu = BuildPlan(source=src, build_dir=build, jobs=2)
    cmd = cpu.configure_cmd()
    assert cmd[:3] == ["cmake", "-S", str(src)] and "-DGGML_CUDA=OFF" in cmd
    assert not any("CUDA_ARCH" in c or "CUDA_COMPILER" in c for c in cmd)
    assert cpu.build_cmd()[-2:] == ["-j", "2"] and cpu.stamp() != cuda.stamp()
    no_native = BuildPlan(source=src, build_dir=build, jobs=2, extra=("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"))
    assert no_native.configure_cmd()[-2:] == ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"]
    assert no_native.stamp() != cpu.stamp()
    with pytest.raises(ValueError, match="must be -DNAME=VALUE"):
        BuildPlan(source=src, build_dir=build, jobs=1, extra=("--fresh",))
    with pytest.raises(ValueError, match="needs both nvcc and cuda_arch"):
        BuildPlan(source=src, build_dir=build, jobs=1, nvcc="/x/nvcc")
    with pytest.raises(ValueError, match="cuda_arch must look like"):
        BuildPlan(source=src, build_dir=build, jobs=1, nvcc="/x/nvcc", cuda_arch="sm_90")


def test_plan_build_picks_cuda_or_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(llamacpp, "cuda_arch_of_visible_gpu", lambda: "90")
    p = plan_build(tmp_path, tmp_path / "b")
    assert (p.nvcc, p.cuda_arch, p.jobs) == ("/opt/cuda/bin/nvcc", "90", os.cpu_count())
    assert plan_build(tmp_path, tmp_path / "b", cuda="off").cuda_arch is None
    assert plan_build(tmp_path, tmp_path / "b", cuda_arch="89", jobs=3).cuda_arch == "89"
    with pytest.raises(LlamaCppError, match="--cmake-arg takes -DNAME=VALUE"):
        plan_build(tmp_path, tmp_path / "b", extra=("GGML_NATIVE=OFF",))
    monkeypatch.setattr(llamacpp, "cuda_arch_of_visible_gpu", lambda: None)
    assert plan_build(tmp_path, tmp_path / "b").nvcc is None  # nvcc but no GPU: CPU-only
    with pytest.raises(LlamaCppError, match="no GPU is visible"):
        plan_build(tmp_path, tmp_path / "b", cuda="on")
    monkeypatch.setattr(llamacpp, "find_nvcc", lambda: None)
    assert plan_build(tmp_path, tmp_path / "b").cuda_arch is None
    with pytest.raises(LlamaCppError, match="nvcc is neither on PATH"):
        plan_build(tmp_path, tmp_path / "b", cuda="on")


def _fake_tree(root: Path) -> Path:
    tree = root / "vendor" / "llama.cpp"
    (tree / "tools" / "llama-bench").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.14)\nproject(fake CXX)\n"
                                         "message(FATAL_ERROR \"fake source: nothing to build\")\n")
    return tree


def test_llama_source_forms_and_errors(tmp_path):
    with pytest.raises(LlamaCppError, match="does not exist"):
        llama_source(tmp_path / "missing.tar.gz", tmp_path / "unpack")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LlamaCppError, match="holds neither tools/llama-bench"):
        llama_source(tmp_path / "empty", tmp_path / "unpack")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(LlamaCppError, match="neither a directory nor a .tar.gz"):
        llama_source(tmp_path / "notes.txt", tmp_path / "unpack")
    tree = _fake_tree(tmp_path / "pkg-1.0")
    assert llama_source(tmp_path / "pkg-1.0", tmp_path / "unpack") == tree
    assert llama_source(tree, tmp_path / "unpack") == tree
    sdist = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(tmp_path / "pkg-1.0", arcname="pkg-1.0")
    root = llama_source(sdist, tmp_path / "unpack")
    assert root == tmp_path / "unpack" / "pkg-1.0" / "vendor" / "llama.cpp" and (root / "CMakeLists.txt").is_file()
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a tar")
    with pytest.raises(LlamaCppError, match="cannot unpack"):
        llama_source(bad, tmp_path / "unpack2")


def test_build_errors_and_reuse(tmp_path, monkeypatch):
    tree = _fake_tree(tmp_path / "src")
    plan = BuildPlan(source=tree, build_dir=tmp_path / "build", jobs=1)
    with pytest.raises(LlamaCppError, match=r"(?s)configure failed .*last lines:\n.*fake source: nothing to build"):
        build_llama_bench(plan, say=lambda s: None)
    assert (plan.build_dir / "build.log").is_file()

    plan.binary.parent.mkdir(parents=True, exist_ok=True)
    plan.binary.write_text("")
    (plan.build_dir / llamacpp.STAMP).write_text(json.dumps(plan.stamp()))
    monkeypatch.setattr(llamacpp.subprocess, "run", lambda *a, **k: pytest.fail("a reused build ran a command"))
    said = []
    assert build_llama_bench(plan, say=said.append) == plan.binary and said == [f"reusing {plan.binary}"]

    (plan.build_dir / llamacpp.STAMP).unlink()
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    with pytest.raises(LlamaCppError, match="cmake was not found on PATH"):
        build_llama_bench(plan, say=lambda s: None)
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: "/usr/bin/cmake" if name == "cmake" else None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(LlamaCppError, match="no C\\+\\+ compiler"):
        build_llama_bench(plan, say=lambda s: None)


def _reader(values: list[float | Exception]):
    """Reads ``values`` in turn, then repeats the last; an exception in the list is raised."""
    seen = []

    def read() -> float:
        value = values[min(len(seen), len(values) - 1)]
        seen.append(value)
        if isinstance(value, Exception):
            raise value
        return value

    return read, seen


def test_gpu_memory_sampler_peak_above_baseline():
    read, seen = _reader([500.0, 700.0, 2500.0, 1800.0])
    with llamacpp.GpuMemorySampler(read=read, period_s=0.001) as s:
        while len(seen) < 5:
            time.sleep(0.001)
    assert (s.baseline_mib, s.max_mib, s.peak_mib) == (500.0, 2500.0, 2000.0)

    read, seen = _reader([100.0, 300.0, OSError("nvidia-smi vanished")])
    with llamacpp.GpuMemorySampler(read=read, period_s=0.001) as s:
        s._thread.join(timeout=5)
    assert s.failed and s.peak_mib is None


def test_fetch_sdist_command_and_errors(tmp_path):
    class Done:
        def __init__(self, returncode: int, stderr: str = "") -> None:
            self.returncode, self.stderr, self.stdout = returncode, stderr, ""

    seen = []

    def offline(cmd, **kw):
        seen.append(cmd)
        return Done(1, "Looking in indexes: https://pypi.org/simple\nERROR: No matching distribution found")

    with pytest.raises(LlamaCppError, match="pip download of llama-cpp-python .* failed: .*No matching distribution"):
        llamacpp.fetch_sdist(tmp_path / "dl", run=offline)
    assert seen[0][1:] == ["-m", "pip", "download", "llama-cpp-python", "--no-binary", ":all:", "--no-deps",
                           "-d", str(tmp_path / "dl")]
    with pytest.raises(LlamaCppError, match="left no llama_cpp_python"):
        llamacpp.fetch_sdist(tmp_path / "dl", run=lambda cmd, **kw: Done(0))

    def saves(cmd, **kw):
        (Path(cmd[-1]) / "llama_cpp_python-0.3.36.tar.gz").write_bytes(b"")
        return Done(0)

    assert llamacpp.fetch_sdist(tmp_path / "dl", run=saves) == tmp_path / "dl" / "llama_cpp_python-0.3.36.tar.gz"


def test_run_llama_bench_failures(tmp_path):
    script = tmp_path / "bench"
    script.write_text(f"#!{sys.executable}\nimport os, signal, sys\n"
                      "if sys.argv[1] == 'ill': os.kill(os.getpid(), signal.SIGILL)\n"
                      "if sys.argv[1] == 'fail': sys.exit('model file not found')\n"
                      "print('[]')\n")
    script.chmod(0o755)
    with pytest.raises(LlamaCppError, match="illegal instruction.*-DGGML_NATIVE=OFF"):
        llamacpp.run_llama_bench([str(script), "ill"], timeout_s=30)
    with pytest.raises(LlamaCppError, match="exited with 1 .*: model file not found"):
        llamacpp.run_llama_bench([str(script), "fail"], timeout_s=30)
    with pytest.raises(LlamaCppError, match="printed 0 tests where one was asked for"):
        llamacpp.run_llama_bench([str(script), "ok"], timeout_s=30)


class _FixedSampler:
    """Stands in for NVML: reports 1000 MiB plus the index it was asked to watch."""

    def __init__(self, index: int) -> None:
        self.peak_mib = 1000.0 + index

    def __enter__(self) -> "_FixedSampler":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_llama_bench_gets_our_gpu_alone(tmp_path, monkeypatch):
    script = tmp_path / "bench"
    script.write_text(f"#!{sys.executable}\nimport json, os\n"
                      "print(json.dumps([{'n_prompt': 1, 'n_gen': 0, 'avg_ts': 1.0, 'stddev_ts': 0.0, "
                      "'backends': os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}]))\n")
    script.chmod(0o755)
    monkeypatch.setattr(llamacpp, "GpuMemorySampler", _FixedSampler)
    run = llamacpp.run_llama_bench([str(script)], timeout_s=30, gpu="3")
    assert run.record.backends == "3" and run.peak_vram_mib == 1003.0
    run = llamacpp.run_llama_bench([str(script)], timeout_s=30, gpu="GPU-8f0c")
    assert run.record.backends == "GPU-8f0c" and run.peak_vram_mib is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert [llamacpp.cuda_visible_entry(i) for i in (0, 1)] == ["2", "5"]
    with pytest.raises(LlamaCppError, match="CUDA device 2 is not among CUDA_VISIBLE_DEVICES=2,5"):
        llamacpp.cuda_visible_entry(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert llamacpp.cuda_visible_entry(1) == "1"


def test_probe_features_missing_binary(tmp_path):
    with pytest.raises(LlamaCppError, match="is not an executable file"):
        probe_features(tmp_path / "llama-bench")


FAKE_BENCH = '''#!{python}
"""Answers like llama-bench: --help, or one JSON test echoing the options it was given."""
import json, sys
args = sys.argv[1:]
if args == ["--help"]:
    print({help!r})
    sys.exit(0)
opt = dict(zip(args[::2], args[1::2]))
assert opt["-o"] == "json" and opt["-fa"] == "on", opt
p, n, r = int(opt["-p"]), int(opt["-n"]), int(opt["-r"])
ns = [1000000 * (k + 1) for k in range(r)]
ts = [1e9 * (p + n) / t for t in ns]
print(json.dumps([{{"build_commit": "fake", "backends": "CPU", "n_prompt": p, "n_gen": n,
                   "n_depth": int(opt["-d"]), "n_cpu_moe": int(opt.get("-ncmoe", 0)),
                   "n_gpu_layers": int(opt["-ngl"]), "flash_attn": 1, "avg_ts": sum(ts) / r,
                   "stddev_ts": 0.0, "samples_ns": ns, "samples_ts": ts}}], indent=2))
'''


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "vs_llamacpp.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _run_stand_in(tmp_path: Path, *args: str) -> tuple[Path, subprocess.CompletedProcess, dict]:
    """The CLI on a tiny model and the stand-in llama-bench on the CPU (prompts 12, gen 3, ncmoe 2, one thread,
    an 8 MiB host probe) with ``args``: the model, the process and its JSON."""
    model = make_model(tmp_path / "tiny.gguf", "tiny", seed=4)
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_BENCH.format(python=sys.executable, help=NEW_HELP))
    fake.chmod(0o755)
    out = tmp_path / "out.json"
    proc = _run_cli("--model", str(model), "--llama-bench", str(fake), "--prompts", "12", "--gen", "3",
                    "--ncmoe", "2", "--device", "cpu", "--bw-mib", "8", "--threads", "1", "--host-probe-mib", "8",
                    "--json", str(out), *args)
    assert proc.returncode == 0, proc.stderr
    return model, proc, json.loads(out.read_text())


def test_cli_end_to_end_with_a_stand_in_binary(tmp_path, bench_script):
    model, proc, result = _run_stand_in(tmp_path, "--depths", "0,9", "--repeats", "2")
    names = [r["name"] for r in result["rows"]]
    assert names == ["pp12", "tg3@d0", "tg3@d9", "pp12 ncmoe2", "tg3@d0 ncmoe2", "tg3@d9 ncmoe2"]
    for row in result["rows"]:
        llama, ours = row["llama"], row["ours"]
        assert (llama["n_prompt"], llama["n_gen"], llama["n_depth"], llama["n_cpu_moe"]) == (
            row["n_prompt"], row["n_gen"], row["depth"], row["ncmoe"])
        assert llama["n_gpu_layers"] == 0 and llama["command"][-2:] == ["-t", "1"]  # --device cpu --threads 1
        assert len(ours["samples_ts"]) == 2 and all(t > 0 for t in ours["samples_ts"])
        assert ("floor_tok_s" in row) == (row["n_gen"] > 0 and row["ncmoe"] == 0)
        for side in (llama, ours):  # the host's state measured around each side
            host = side["host"]
            assert host["read_gbs"] > 0 and host["wall_s"] > 0 and host["steal_pct"] >= 0
            assert len(host["read_gbs_passes"]) == 3 and host["read_gbs"] == sorted(host["read_gbs_passes"])[1]
            assert host["own_cores"] >= 0 and host["others_cores"] >= 0
        assert llama["host"]["own_cores"] > 0.2  # the stand-in's CPU time counts as the side's own
    cfg_bytes = active_bytes(model)
    assert result["active_bytes"]["per_token"] == cfg_bytes.per_token
    ncmoe = result["ours"]["ncmoe"]
    assert ncmoe["budget_mb"] == pytest.approx(ncmoe["all_experts_mb"] / 2)  # 2 of 4 layers stay on the device
    assert ncmoe["cold_cpu_share"] == 0.0 and ncmoe["placement_unit"] == "expert"
    host_notes = bench_script("vs_llamacpp").host_notes
    assert result["notes"] == host_notes(result["rows"])  # no note but the host's (a shared CPU)
    assert "ours/llama" in proc.stdout and "others' cores" in proc.stdout


def test_cli_interleaved_runs_each_repeat_in_turns(tmp_path, bench_script):
    """``--interleave``: per test, a llama-bench process of one repeat before each run of ours; llama.cpp's
    samples gathered from those processes, and each pair's ratio kept."""
    _, proc, result = _run_stand_in(tmp_path, "--depths", "0", "--repeats", "3", "--interleave")
    assert result["ours"]["interleaved"] == "all"
    order = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith(("llama.cpp ", "ours "))]
    expected = []
    for name in ("pp12", "tg3@d0", "pp12 ncmoe2", "tg3@d0 ncmoe2"):
        expected += [f"llama.cpp {name}"] * 3 + [f"ours {name}"]
    assert order == expected  # ours loaded first, then each test's llama.cpp processes before its ours line
    for row in result["rows"]:
        llama, ours = row["llama"], row["ours"]
        assert llama["processes"] == 3 and len(llama["samples_ts"]) == 3
        assert llama["command"][llama["command"].index("-r") + 1] == "1"  # one repeat a process
        assert llama["median_ts"] == pytest.approx(sorted(llama["samples_ts"])[1])
        assert len(ours["samples_ts"]) == 3
        assert row["pair_ratios"] == pytest.approx([o / ll for o, ll in zip(ours["samples_ts"], llama["samples_ts"])])
        assert llama["host"]["wall_s"] > 0 and ours["host"]["wall_s"] > 0
    assert result["notes"] == bench_script("vs_llamacpp").host_notes(result["rows"])


def test_cli_interleaves_the_ncmoe_pass_only(tmp_path, bench_script):
    """``--interleave ncmoe``: the all-on-device tests back to back (one llama-bench process of every repeat right
    before ours), the -ncmoe pass's tests in turns as with ``--interleave``."""
    _, proc, result = _run_stand_in(tmp_path, "--depths", "0", "--repeats", "3", "--interleave", "ncmoe")
    assert result["ours"]["interleaved"] == "ncmoe"
    order = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith(("llama.cpp ", "ours "))]
    expected = []
    for name in ("pp12", "tg3@d0"):
        expected += [f"llama.cpp {name}", f"ours {name}"]
    for name in ("pp12 ncmoe2", "tg3@d0 ncmoe2"):
        expected += [f"llama.cpp {name}"] * 3 + [f"ours {name}"]
    assert order == expected
    for row in result["rows"]:
        llama, repeats = row["llama"], llama_repeats(row["llama"]["command"])
        if row["ncmoe"]:
            assert repeats == 1 and llama["processes"] == 3 and len(row["pair_ratios"]) == 3
        else:
            assert repeats == 3 and "processes" not in llama and "pair_ratios" not in row
        assert len(llama["samples_ts"]) == 3 and len(row["ours"]["samples_ts"]) == 3
    proc = _run_cli("--model", "x.gguf", "--llama-bench", "x", "--interleave", "some")
    assert proc.returncode != 0 and "--interleave" in proc.stderr


def llama_repeats(command: list[str]) -> int:
    return int(command[command.index("-r") + 1])


def test_merge_llama_gathers_one_repeat_processes(bench_script):
    vs = bench_script("vs_llamacpp")
    host = {"wall_s": 1.0, "cores": 2.0, "own_cores": 1.0, "others_cores": 1.0, "steal_pct": 0.0,
            "preempted_per_s": 10.0, "read_gbs": 30.0}
    parts = [{"samples_ts": [t], "median_ts": t, "peak_vram_mib": vram, "wall_s": 2.0, "command": ["x", str(i)],
              "host": host | {"wall_s": w, "others_cores": oc, "read_gbs": gbs}}
             for i, (t, vram, w, oc, gbs) in enumerate([(100.0, 10.0, 1.0, 0.0, 30.0), (90.0, None, 3.0, 2.0, 20.0),
                                                         (110.0, 12.0, 1.0, 0.0, 40.0)])]
    merged = vs.merge_llama(parts)
    assert merged["samples_ts"] == [100.0, 90.0, 110.0] and merged["median_ts"] == 100.0
    assert merged["avg_ts"] == pytest.approx(100.0) and merged["stddev_ts"] == pytest.approx(10.0)
    assert merged["peak_vram_mib"] == 12.0 and merged["wall_s"] == 6.0 and merged["processes"] == 3
    assert merged["command"] == ["x", "0"]
    assert merged["host"]["wall_s"] == 5.0 and merged["host"]["others_cores"] == pytest.approx(6.0 / 5.0)
    assert merged["host"]["read_gbs"] == 30.0 and merged["host"]["cores"] == pytest.approx(2.0)
    assert merged["host"]["preempted_per_s"] == pytest.approx(10.0)


def test_cli_clear_errors(tmp_path):
    model = make_model(tmp_path / "tiny.gguf", "tiny", seed=4)
    proc = _run_cli("--model", str(model), "--llama-bench", str(tmp_path / "nope"), "--device", "cpu")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: --llama-bench {tmp_path / 'nope'} is not an executable file"
    proc = _run_cli("--model", str(model), "--llama-src", str(tmp_path / "src.tar.gz"), "--device", "cpu",
                    "--build-dir", str(tmp_path / "b"))
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: --llama-src {tmp_path / 'src.tar.gz'} does not exist"
    proc = _run_cli("--model", str(model), "--llama-bench", str(tmp_path / "nope"), "--device", "tpu")
    assert proc.returncode == 1 and proc.stderr.strip() == "error: --device 'tpu' is not a device (auto, cpu, cuda or cuda:N)"
    proc = _run_cli("--model", str(model))
    assert proc.returncode == 2 and "one of the arguments --llama-bench --llama-src --fetch-sdist is required" in proc.stderr


@pytest.mark.parametrize("extra, message", [
    (["--cold-cpu-share", "1.5"], "--cold-cpu-share must be between 0 and 1, got 1.5"),
    (["--cold-cpu-share", "0.6"], "--cold-cpu-share needs --ncmoe, --cold-device gpu and --experts quantized"),
    (["--cold-cpu-share", "0.6", "--ncmoe", "2", "--experts", "quantized"],
     "--cold-cpu-share needs --ncmoe, --cold-device gpu and --experts quantized"),
    (["--cold-prefetch", "5"], "--cold-prefetch must be from 0 to 4, got 5"),
    (["--cold-warm", "9"], "--cold-warm must be from 0 to 8, got 9"),
    (["--cold-prefetch", "1"], "--cold-prefetch needs --cold-cpu-share above 0"),
    (["--cold-prefetch", "1", "--cold-cpu-share", "0", "--ncmoe", "2", "--cold-device", "gpu", "--experts",
      "quantized"], "--cold-prefetch needs --cold-cpu-share above 0"),
])
def test_cold_cpu_share_is_checked_up_front(tmp_path, extra, message):
    """A CPU share the half-cold rows cannot use is refused before anything loads or runs."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    proc = _run_cli("--model", str(model), "--llama-bench", str(tmp_path / "nope"), *extra)
    assert proc.returncode == 2 and message in proc.stderr


def _side(read_gbs: float, others: float = 0.0, steal: float = 0.0) -> dict:
    return {"host": {"read_gbs": read_gbs, "others_cores": others, "steal_pct": steal, "own_cores": 1.0,
                     "wall_s": 1.0, "cores": 1.0 + others}}


def test_host_notes_name_rows_measured_on_a_changed_host(bench_script):
    rows = [{"name": "tg64@d0", "ours": _side(40.0), "llama": _side(38.0)},  # 5%: alike
            {"name": "tg64@d0 ncmoe20", "ours": _side(40.0), "llama": _side(20.0)},
            {"name": "pp512", "ours": _side(40.0, others=2.5), "llama": _side(40.0, steal=3.0)},
            {"name": "pp8192", "ours": None, "llama": _side(40.0)}]  # one side not measured
    notes = bench_script("vs_llamacpp").host_notes(rows)
    assert notes == [
        "tg64@d0 ncmoe20: the host's read rate was 40.0 GB/s before ours and 20.0 before llama.cpp's; the host "
        "changed between the two",
        "pp512: other processes kept 2.5 cores busy while ours ran",
        "pp512: the hypervisor took 3.0% of the CPUs' time while llama.cpp ran"]


def test_host_load_counts_other_processes_and_reaped_children(bench_script):
    """``HostLoad`` splits the CPUs' busy time into this process's (with the children it reaped) and the rest's."""
    HostLoad = bench_script("common").HostLoad
    spin = [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass"]
    with HostLoad() as load:
        subprocess.run(spin, check=True)
    assert load.result["own_cores"] > 0.5 and load.result["wall_s"] >= 1.0
    with HostLoad() as load:
        other = subprocess.Popen(spin)
        time.sleep(1.1)
    other.wait()
    assert load.result["others_cores"] > 0.5 and load.result["own_cores"] < 0.3


def test_host_load_counts_preemptions_of_its_threads_and_reaped_children(bench_script):
    """``HostLoad``'s ``preempted_per_s``: four reaped children spinning on one core are taken off it
    (involuntary switches) many times a second; a block that sleeps is not."""
    HostLoad = bench_script("common").HostLoad
    spin = [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass"]
    cpu = min(os.sched_getaffinity(0))
    with HostLoad() as load:
        procs = [subprocess.Popen(spin, preexec_fn=lambda: os.sched_setaffinity(0, {cpu})) for _ in range(4)]
        for p in procs:
            p.wait()
    assert load.result["preempted_per_s"] > 20
    with HostLoad() as load:
        time.sleep(0.5)
    assert load.result["preempted_per_s"] < 20
