"""bench/host_dot_rate.c builds against the pool's source as it stands and reports a rate per matrix."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_builds_and_reports_positive_rates(tmp_path):
    exe = tmp_path / "host_dot_rate"
    subprocess.run(["cc", "-O2", "-march=native", "-pthread", str(ROOT / "bench" / "host_dot_rate.c"), "-o", str(exe),
                    "-lm"], check=True, capture_output=True)
    out = subprocess.run([str(exe), "quick"], check=True, capture_output=True, text=True, timeout=60).stdout
    rates = [float(v) for v in re.findall(r"\(590 KB\):\s+([0-9.]+)", out)]
    assert len(rates) == 2 and all(r > 0 for r in rates), out
