"""llama.cpp's llama-bench: fetch its source, build it, run it and read its JSON.

Nothing here imports torch or the engine, so the parsing and the command lines are testable
without a build or a GPU. Every failure a user can cause is a ``LlamaCppError`` whose message
is one sentence (a failed build adds the last lines of its log).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

STAMP = "luce-build.json"
LOG_TAIL_LINES = 15


class LlamaCppError(Exception):
    """A user-facing problem with getting or running llama-bench."""


def fetch_sdist(dest: Path, run: Callable[..., Any] = subprocess.run) -> Path:
    """Download the llama-cpp-python source distribution (it vendors llama.cpp) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "llama-cpp-python", "--no-binary", ":all:",
           "--no-deps", "-d", str(dest)]
    proc = run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        raise LlamaCppError(f"pip download of llama-cpp-python into {dest} failed: {tail}")
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise LlamaCppError(f"pip download finished but left no llama_cpp_python-*.tar.gz in {dest}")
    return found[-1]


def _llama_root(tree: Path) -> Path | None:
    for candidate in (tree, tree / "vendor" / "llama.cpp"):
        if (candidate / "CMakeLists.txt").is_file() and (candidate / "tools" / "llama-bench").is_dir():
            return candidate
    return None


def llama_source(path: Path, unpack_dir: Path) -> Path:
    """The llama.cpp source root in ``path``: a llama.cpp tree, an unpacked llama-cpp-python
    sdist, or the sdist's .tar.gz (unpacked once into ``unpack_dir``)."""
    if not path.exists():
        raise LlamaCppError(f"--llama-src {path} does not exist")
    if path.is_dir():
        root = _llama_root(path)
        if root is None:
            raise LlamaCppError(f"--llama-src {path} holds neither tools/llama-bench nor "
                                "vendor/llama.cpp/tools/llama-bench")
        return root
    if not path.name.endswith((".tar.gz", ".tgz")):
        raise LlamaCppError(f"--llama-src {path} is neither a directory nor a .tar.gz source distribution")
    top = unpack_dir / path.name.removesuffix(".tar.gz").removesuffix(".tgz")
    if not top.is_dir():
        unpack_dir.mkdir(parents=True, exist_ok=True)
        try:
            with tarfile.open(path) as tar:
                tar.extractall(unpack_dir, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise LlamaCppError(f"cannot unpack --llama-src {path}: {exc}") from None
    root = _llama_root(top) if top.is_dir() else None
    if root is None:
        roots = [r for d in sorted(unpack_dir.iterdir()) if d.is_dir() and (r := _llama_root(d))]
        if not roots:
            raise LlamaCppError(f"--llama-src {path} unpacked to {unpack_dir} without vendor/llama.cpp in it")
        root = roots[0]
    return root


def cuda_arch_of_visible_gpu() -> str | None:
    """Compute capability of the first visible GPU as CMake wants it ("90"), or None."""
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True)
        lines = proc.stdout.split() if proc.returncode == 0 else []
        if lines and re.fullmatch(r"\d+\.\d+", lines[0]):
            return lines[0].replace(".", "")
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return f"{major}{minor}"
    return None


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = Path(home) / "bin" / "nvcc"
    return str(nvcc) if nvcc.is_file() else None


@dataclass(frozen=True)
class BuildPlan:
    """How llama-bench gets built: CUDA when ``nvcc`` and ``cuda_arch`` are set, CPU-only otherwise."""

    source: Path
    build_dir: Path
    jobs: int
    nvcc: str | None = None
    cuda_arch: str | None = None
    generator: str | None = None  # "Ninja" when ninja is on PATH, else CMake's default
    extra: tuple[str, ...] = ()  # further configure arguments, e.g. ("-DGGML_NATIVE=OFF",)

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {self.jobs}")
        if (self.nvcc is None) != (self.cuda_arch is None):
            raise ValueError(f"a CUDA build needs both nvcc and cuda_arch, got {self.nvcc!r} and {self.cuda_arch!r}")
        if self.cuda_arch is not None and not re.fullmatch(r"\d{2,3}[a-z]?", self.cuda_arch):
            raise ValueError(f"cuda_arch must look like '90' or '90a', got {self.cuda_arch!r}")
        bad = [a for a in self.extra if not a.startswith("-D")]
        if bad:
            raise ValueError(f"extra configure arguments must be -DNAME=VALUE definitions, got {bad}")

    @property
    def cmake_dir(self) -> Path:
        return self.build_dir / "cmake"

    @property
    def binary(self) -> Path:
        return self.cmake_dir / "bin" / "llama-bench"

    @property
    def log(self) -> Path:
        return self.build_dir / "build.log"

    def configure_cmd(self) -> list[str]:
        cmd = ["cmake", "-S", str(self.source), "-B", str(self.cmake_dir), "-DCMAKE_BUILD_TYPE=Release",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON",
               "-DLLAMA_OPENSSL=OFF"]
        if self.generator:
            cmd[1:1] = ["-G", self.generator]
        if self.cuda_arch is None:
            cmd.append("-DGGML_CUDA=OFF")
        else:
            cmd += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={self.nvcc}",
                    f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_arch}"]
        return cmd + list(self.extra)

    def build_cmd(self) -> list[str]:
        return ["cmake", "--build", str(self.cmake_dir), "--config", "Release", "--target", "llama-bench",
                "-j", str(self.jobs)]

    def stamp(self) -> dict[str, Any]:
        """What decides whether an existing build can be reused (not the job count)."""
        return {"source": str(self.source.resolve()), "cuda_arch": self.cuda_arch, "extra": list(self.extra)}


def plan_build(source: Path, build_dir: Path, *, cuda: str = "auto", cuda_arch: str | None = None,
               jobs: int | None = None, extra: tuple[str, ...] = ()) -> BuildPlan:
    """``cuda``: "auto" builds for CUDA when nvcc is found and a GPU (or ``cuda_arch``) says for
    which architecture; "on" insists on it; "off" builds for the CPU only."""
    if cuda not in ("auto", "on", "off"):
        raise LlamaCppError(f"--cuda must be auto, on or off, got {cuda!r}")
    nvcc = arch = None
    if cuda != "off":
        nvcc = find_nvcc()
        if nvcc is None and cuda == "on":
            raise LlamaCppError("--cuda on was asked for, but nvcc is neither on PATH nor in $CUDA_HOME/bin")
        if nvcc is not None:
            arch = cuda_arch or cuda_arch_of_visible_gpu()
            if arch is None and cuda == "on":
                raise LlamaCppError("--cuda on was asked for, but no GPU is visible to read the compute "
                                    "capability from; pass --cuda-arch (e.g. 90 for an H200)")
            if arch is None:
                nvcc = None
    bad = [a for a in extra if not a.startswith("-D")]
    if bad:
        raise LlamaCppError(f"--cmake-arg takes -DNAME=VALUE definitions, got {bad[0]!r}")
    return BuildPlan(source=source, build_dir=build_dir, jobs=jobs or os.cpu_count() or 1, nvcc=nvcc,
                     cuda_arch=arch, generator="Ninja" if shutil.which("ninja") else None, extra=tuple(extra))


def _check_toolchain(plan: BuildPlan) -> None:
    if shutil.which("cmake") is None:
        raise LlamaCppError("cmake was not found on PATH: install cmake (3.14 or newer) or pass "
                            "--llama-bench with an existing binary")
    cxx = os.environ.get("CXX")
    if not (cxx and shutil.which(cxx)) and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise LlamaCppError("no C++ compiler was found (set CXX, or install g++ or clang++) to build llama-bench")
    if plan.generator == "Ninja" and shutil.which("ninja") is None:
        raise LlamaCppError("the build plan uses Ninja, but ninja is not on PATH")


def _log_tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return "\n".join("    " + line for line in lines[-LOG_TAIL_LINES:])


def build_llama_bench(plan: BuildPlan, *, say: Callable[[str], None] = print) -> Path:
    """Configure and build only the llama-bench target, or reuse a build made by the same plan."""
    stamp_path = plan.build_dir / STAMP
    if plan.binary.is_file() and stamp_path.is_file():
        if json.loads(stamp_path.read_text()) == plan.stamp():
            say(f"reusing {plan.binary}")
            return plan.binary
    _check_toolchain(plan)
    plan.build_dir.mkdir(parents=True, exist_ok=True)
    kind = f"CUDA sm_{plan.cuda_arch}" if plan.cuda_arch else "CPU-only"
    say(f"building llama-bench ({kind}, -j {plan.jobs}) from {plan.source}; log in {plan.log}")
    stamp_path.unlink(missing_ok=True)
    with plan.log.open("w") as log:
        for step, cmd in (("configure", plan.configure_cmd()), ("build", plan.build_cmd())):
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise LlamaCppError(f"llama.cpp {step} failed with exit code {rc} (full log: {plan.log}); "
                                    f"last lines:\n{_log_tail(plan.log)}")
    if not plan.binary.is_file():
        raise LlamaCppError(f"the build finished but {plan.binary} is missing (full log: {plan.log})")
    stamp_path.write_text(json.dumps(plan.stamp()))
    return plan.binary


@dataclass(frozen=True)
class BenchFeatures:
    """What this llama-bench build accepts, read from its --help."""

    depth: bool  # -d / --n-depth
    ncmoe: bool  # -ncmoe / --n-cpu-moe
    fa_on: str  # the value of -fa that turns flash attention on: "on" (newer) or "1" (older)


def parse_help(text: str) -> BenchFeatures:
    if "--n-prompt" not in text or "--output" not in text:
        raise LlamaCppError("the --help text does not look like llama-bench's (no --n-prompt/--output)")
    fa = re.search(r"--flash-attn\s+<([^>]*)>", text)
    return BenchFeatures(depth="--n-depth" in text, ncmoe="--n-cpu-moe" in text,
                         fa_on="on" if fa and "on" in fa.group(1).split("|") else "1")


def probe_features(binary: Path) -> BenchFeatures:
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise LlamaCppError(f"--llama-bench {binary} is not an executable file")
    try:
        proc = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LlamaCppError(f"cannot run {binary} --help: {exc}") from None
    return parse_help(proc.stdout + proc.stderr)


@dataclass(frozen=True)
class BenchTest:
    """One llama-bench measurement: prompt processing (n_gen 0) or generation (n_prompt 0)."""

    name: str
    n_prompt: int
    n_gen: int
    depth: int = 0
    ncmoe: int = 0

    def __post_init__(self) -> None:
        if (self.n_prompt > 0) == (self.n_gen > 0) or min(self.n_prompt, self.n_gen, self.depth, self.ncmoe) < 0:
            raise ValueError(f"{self.name}: exactly one of n_prompt ({self.n_prompt}) and n_gen ({self.n_gen}) "
                             f"must be positive, depth ({self.depth}) and ncmoe ({self.ncmoe}) >= 0")


def bench_command(binary: Path, model: Path, test: BenchTest, features: BenchFeatures, *,
                  n_gpu_layers: int, repeats: int, threads: int | None = None) -> list[str]:
    """The llama-bench command line for one test; raises when the build lacks an option it needs."""
    if test.depth and not features.depth:
        raise LlamaCppError(f"{test.name}: this llama-bench has no -d/--n-depth option")
    if test.ncmoe and not features.ncmoe:
        raise LlamaCppError(f"{test.name}: this llama-bench has no -ncmoe/--n-cpu-moe option")
    cmd = [str(binary), "-m", str(model), "-p", str(test.n_prompt), "-n", str(test.n_gen),
           "-ngl", str(n_gpu_layers), "-fa", features.fa_on, "-r", str(repeats), "-o", "json"]
    if features.depth:
        cmd += ["-d", str(test.depth)]
    if test.ncmoe:
        cmd += ["-ncmoe", str(test.ncmoe)]
    if threads is not None:
        cmd += ["-t", str(threads)]
    return cmd


@dataclass(frozen=True)
class BenchRecord:
    """One test object of llama-bench's JSON output."""

    n_prompt: int
    n_gen: int
    n_depth: int
    n_cpu_moe: int
    n_gpu_layers: int
    flash_attn: int
    samples_ts: tuple[float, ...]
    avg_ts: float
    stddev_ts: float
    build_commit: str
    backends: str
    gpu_info: str
    model_type: str
    model_size: int

    @property
    def median_ts(self) -> float:
        s = sorted(self.samples_ts)
        if not s:
            return self.avg_ts
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2

    def as_dict(self) -> dict[str, Any]:
        return {"n_prompt": self.n_prompt, "n_gen": self.n_gen, "n_depth": self.n_depth, "n_cpu_moe": self.n_cpu_moe,
                "n_gpu_layers": self.n_gpu_layers, "flash_attn": self.flash_attn, "samples_ts": list(self.samples_ts),
                "median_ts": self.median_ts, "avg_ts": self.avg_ts, "stddev_ts": self.stddev_ts,
                "build_commit": self.build_commit, "backends": self.backends, "gpu_info": self.gpu_info,
                "model_type": self.model_type, "model_size": self.model_size}


def parse_bench_json(text: str, source: str = "llama-bench output") -> list[BenchRecord]:
    """Parse ``llama-bench -o json`` (a JSON array of test objects); older builds lack
    n_depth/n_cpu_moe (read as 0) and print flash_attn as a boolean."""
    start = text.find("[")
    try:
        data = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as exc:
        raise LlamaCppError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise LlamaCppError(f"{source} holds no JSON array of tests")
    records = []
    for i, item in enumerate(data):
        missing = [k for k in ("n_prompt", "n_gen", "avg_ts", "stddev_ts") if k not in item]
        if missing:
            raise LlamaCppError(f"{source}: test {i} lacks {', '.join(missing)}")
        records.append(BenchRecord(
            n_prompt=int(item["n_prompt"]), n_gen=int(item["n_gen"]), n_depth=int(item.get("n_depth", 0)),
            n_cpu_moe=int(item.get("n_cpu_moe", 0)), n_gpu_layers=int(item.get("n_gpu_layers", 0)),
            flash_attn=int(item.get("flash_attn", 0)),
            samples_ts=tuple(float(x) for x in item.get("samples_ts", [])),
            avg_ts=float(item["avg_ts"]), stddev_ts=float(item["stddev_ts"]),
            build_commit=str(item.get("build_commit", "")), backends=str(item.get("backends", "")),
            gpu_info=str(item.get("gpu_info", "")), model_type=str(item.get("model_type", "")),
            model_size=int(item.get("model_size", 0))))
    return records


class GpuMemorySampler:
    """Peak memory in use on one GPU (MiB above the level at start) while a process runs,
    sampled through NVML, or nvidia-smi when NVML is missing; on a GPU shared with other
    work it counts theirs too. ``peak_mib`` is None when neither is available or a sample
    failed. ``read`` replaces the device query (MiB in use)."""

    def __init__(self, index: int = 0, period_s: float = 0.1, read: Callable[[], float] | None = None) -> None:
        self.index = index
        self.period_s = period_s
        self._read = read or self._reader()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.baseline_mib: float | None = None
        self.max_mib: float | None = None
        self.failed = False

    def _reader(self) -> Callable[[], float] | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
        except Exception:  # no NVML library or no driver: fall back to nvidia-smi
            pass
        if shutil.which("nvidia-smi") is None:
            return None

        def smi() -> float:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", str(self.index)], capture_output=True, text=True, timeout=10).stdout
            return float(out.split()[0])

        try:
            smi()
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None
        return smi

    def __enter__(self) -> "GpuMemorySampler":
        if self._read is not None:
            self.baseline_mib = self.max_mib = self._read()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                used = self._read()
            except Exception:  # NVML or nvidia-smi gave out mid-run: no peak rather than a low one
                self.failed = True
                return
            self.max_mib = max(self.max_mib or 0.0, used)
            self._stop.wait(self.period_s)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def peak_mib(self) -> float | None:
        if self.baseline_mib is None or self.max_mib is None or self.failed:
            return None
        return self.max_mib - self.baseline_mib


def cuda_visible_entry(ordinal: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry (an NVML index or a UUID) of CUDA device ``ordinal``."""
    visible = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    if not visible:
        return str(ordinal)
    if ordinal >= len(visible):
        raise LlamaCppError(f"CUDA device {ordinal} is not among CUDA_VISIBLE_DEVICES={','.join(visible)}")
    return visible[ordinal]


@dataclass(frozen=True)
class BenchRun:
    record: BenchRecord
    peak_vram_mib: float | None
    wall_s: float
    command: list[str]


def run_llama_bench(cmd: list[str], *, timeout_s: float, gpu: str | None = None) -> BenchRun:
    """Run one llama-bench command that measures one test. ``gpu`` (a CUDA_VISIBLE_DEVICES
    entry) confines it to that one GPU, whose memory is sampled meanwhile when it is an index."""
    t0 = time.perf_counter()
    env = None if gpu is None else os.environ | {"CUDA_VISIBLE_DEVICES": gpu}
    sampler = GpuMemorySampler(int(gpu)) if gpu is not None and gpu.isdigit() else None
    try:
        with sampler or contextlib.nullcontext():
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"llama-bench ran past {timeout_s:.0f} s: {' '.join(cmd)}") from None
    except OSError as exc:
        raise LlamaCppError(f"cannot run {cmd[0]}: {exc}") from None
    if proc.returncode == -signal.SIGILL:
        raise LlamaCppError("llama-bench died of an illegal instruction: a -march=native build on a CPU that "
                            "advertises more than it runs (AMX in some VMs); rebuild with --cmake-arg=-DGGML_NATIVE=OFF "
                            "and the ISA it has, e.g. --cmake-arg=-DGGML_AVX2=ON --cmake-arg=-DGGML_FMA=ON "
                            "--cmake-arg=-DGGML_F16C=ON")
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise LlamaCppError(f"llama-bench exited with {proc.returncode} ({' '.join(cmd)}): {tail}")
    records = parse_bench_json(proc.stdout)
    if len(records) != 1:
        raise LlamaCppError(f"llama-bench printed {len(records)} tests where one was asked for: {' '.join(cmd)}")
    return BenchRun(record=records[0], peak_vram_mib=sampler.peak_mib if sampler else None,
                    wall_s=time.perf_counter() - t0, command=cmd)
