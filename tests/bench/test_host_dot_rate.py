"""bench/host_dot_rate.c builds against the pool's source as it stands and reports a rate per matrix."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    path = tmp_path_factory.mktemp("dot") / "host_dot_rate"
    subprocess.run(["cc", "-O2", "-march=native", "-pthread", str(ROOT / "bench" / "host_dot_rate.c"), "-o", str(path),
                    "-lm"], check=True, capture_output=True)
    return path


def test_builds_and_reports_positive_rates(exe):
    out = subprocess.run([str(exe), "quick"], check=True, capture_output=True, text=True, timeout=60).stdout
    rates = [float(v) for v in re.findall(r"\(590 KB\):\s+([0-9.]+)", out)]
    assert len(rates) == 2 and all(r > 0 for r in rates), out


def test_threads_mode_times_every_phase_on_every_thread(exe):
    """Two threads, 18 KB regions of down-like rows, 8 MB in all: the five phases each report a time and a rate."""
    out = subprocess.run([str(exe), "threads", "2", "18", "512", "8"], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    assert "2 threads" in out and "(64 rows x 512 cols)" in out, out
    phases = re.findall(r"^  (\S.*?) +([0-9.]+) us \(slowest +([0-9.]+)\) +([0-9.]+) GB/s a thread$", out, re.M)
    assert [p[0] for p in phases] == ["computed cold", "warm-up by loads", "computed after loads",
                                      "warm-up by prefetches", "computed after prefetches"], out
    assert all(float(mean) > 0 and float(slow) >= float(mean) and float(rate) > 0 for _, mean, slow, rate in phases), out


@pytest.mark.parametrize("args", [["threads", "0"], ["threads", "2", "18", "500"], ["threads", "2", "0"]])
def test_threads_mode_refuses_bad_sizes(exe, args):
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "threads T" in done.stderr, (done.returncode, done.stderr)
