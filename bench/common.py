"""What every benchmark script records beside its numbers: the machine, the commit, spreads."""

from __future__ import annotations

import platform
import statistics
import subprocess

import torch


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def time_ms(fn, warmup: int, repeats: int) -> dict[str, float]:
    """Median and 20th/80th percentiles of ``repeats`` calls of ``fn`` on CUDA, each timed with
    CUDA events after ``warmup`` untimed calls, in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    q = statistics.quantiles(times, n=5) if len(times) > 1 else times * 4
    return {"ms": statistics.median(times), "p20_ms": q[0], "p80_ms": q[3]}
