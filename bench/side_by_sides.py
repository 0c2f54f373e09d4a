"""Every recorded side by side's half-cold decode in one table, and how its ratio follows llama.cpp's speed.

    python bench/side_by_sides.py [--dir docs/bench-data] [--out docs/side_by_sides.md]

Reads each ``vs_llamacpp*.json`` that ``bench/vs_llamacpp.py --json`` wrote under ``--dir`` and, for each with a
decode row at depth 0 under ``-ncmoe`` (half the experts cold), prints one line: the date, the GPU, ours and
llama.cpp's medians over their samples, the ratio, the all-GPU row's ratio beside it, both sides' peak device
memory and our cold-tier settings. Then, over the runs with the settings given by ``--share``, ``--unit``,
``--prefetch`` and ``--warm`` (the side by side's current ones by default), the correlation of the ratio and of our
speed with llama.cpp's: where the ratio follows llama.cpp's speed while ours stays put, the host decides whether a
ratio target is met. Files that are not a side by side's JSON are named and skipped."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Run:
    file: str
    date: str
    machine: str
    ours: float
    llama: float
    gpu_ratio: float | None
    vram_ours: float | None
    vram_llama: float | None
    settings: dict[str, Any]

    @property
    def ratio(self) -> float:
        return self.ours / self.llama


def _median(side: dict[str, Any]) -> float | None:
    samples = side.get("samples_ts") or []
    return statistics.median(samples) if samples else side.get("median_ts")


def _decode_row(rows: list[dict[str, Any]], cold: bool) -> dict[str, Any] | None:
    for r in rows:
        if r.get("n_gen", 0) > 0 and r.get("depth", 0) == 0 and bool(r.get("ncmoe")) == cold:
            if r.get("ours") and r.get("llama") and _median(r["ours"]) and _median(r["llama"]):
                return r
    return None


def read_run(path: Path) -> Run | None:
    """The half-cold run of one side by side's JSON, or None where it has no such row measured on both sides."""
    data = json.loads(path.read_text())
    rows = data.get("rows")
    if not isinstance(rows, list):
        raise ValueError("no 'rows' list")
    half = _decode_row(rows, cold=True)
    if half is None:
        return None
    gpu = _decode_row(rows, cold=False)
    ncmoe = data.get("ours", {}).get("ncmoe", {})
    settings = {k: ncmoe.get(k) for k in ("placement_unit", "cold_cpu_share", "cold_prefetch", "cold_warm",
                                          "fetch_copier")}
    return Run(file=path.name, date=str(data.get("date", ""))[:10], machine=str(data.get("machine", "?")),
               ours=_median(half["ours"]), llama=_median(half["llama"]),
               gpu_ratio=_median(gpu["ours"]) / _median(gpu["llama"]) if gpu else None,
               vram_ours=half["ours"].get("peak_vram_mib"), vram_llama=half["llama"].get("peak_vram_mib"),
               settings=settings)


def read_runs(folder: Path) -> tuple[list[Run], list[str]]:
    """Every half-cold run under ``folder`` (by date, then file name) and the files skipped, with why."""
    runs, skipped = [], []
    for path in sorted(folder.glob("vs_llamacpp*.json")):
        try:
            run = read_run(path)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            skipped.append(f"{path.name}: {exc}")
            continue
        if run is not None:
            runs.append(run)
    runs.sort(key=lambda r: (r.date, r.file))
    return runs, skipped


def correlation(xs: list[float], ys: list[float]) -> float | None:
    """Pearson's r, or None under three points or with a constant side."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(xs, ys)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _short_gpu(machine: str) -> str:
    return "H200" if "H200" in machine else "H100" if "H100" in machine else machine


def report(runs: list[Run], current: dict[str, Any], skipped: list[str]) -> str:
    lines = ["| date | GPU | run | ours half cold (tok/s) | llama.cpp `-ncmoe` | ratio | all on the GPU, ratio | "
             "device MiB ours / llama.cpp | unit, share, fetch, warm |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r.settings
        knobs = ", ".join(_fmt(s[k], 2) if isinstance(s[k], float) else str(s[k] if s[k] is not None else "-")
                          for k in ("placement_unit", "cold_cpu_share", "cold_prefetch", "cold_warm"))
        lines.append(f"| {r.date} | {_short_gpu(r.machine)} | `{r.file}` | {_fmt(r.ours)} | {_fmt(r.llama)} | "
                     f"{r.ratio:.2f} | {_fmt(r.gpu_ratio, 2)} | {_fmt(r.vram_ours, 0)} / {_fmt(r.vram_llama, 0)} | "
                     f"{knobs} |")
    same = [r for r in runs if all(r.settings.get(k) == v for k, v in current.items())]
    wanted = ", ".join(f"{k} {v}" for k, v in current.items())
    lines += ["", f"Runs with {wanted}: {len(same)}."]
    if same:
        ratios = [r.ratio for r in same]
        llama = [r.llama for r in same]
        ours = [r.ours for r in same]
        lines.append(f"- ratio: median {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); "
                     f"{sum(x >= 2.5 for x in ratios)} of {len(same)} at 2.5x or more")
        lines.append(f"- ours: {statistics.median(ours):.1f} tok/s ({min(ours):.1f}-{max(ours):.1f}); llama.cpp: "
                     f"{statistics.median(llama):.1f} ({min(llama):.1f}-{max(llama):.1f})")
        r_ratio, r_ours = correlation(llama, ratios), correlation(llama, ours)
        lines.append(f"- correlation with llama.cpp's speed: the ratio's {_fmt(r_ratio, 2)}, ours' {_fmt(r_ours, 2)}")
    if skipped:
        lines += ["", "Skipped:"] + [f"- {s}" for s in skipped]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("docs/bench-data"))
    ap.add_argument("--out", type=Path, default=None, help="also write the report here (markdown)")
    ap.add_argument("--unit", default="alternate")
    ap.add_argument("--share", type=float, default=0.45)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--warm", type=int, default=4)
    args = ap.parse_args(argv)
    if not args.dir.is_dir():
        sys.exit(f"error: {args.dir} is not a folder")
    runs, skipped = read_runs(args.dir)
    if not runs:
        sys.exit(f"error: no side by side with a half-cold decode row under {args.dir}")
    current = {"placement_unit": args.unit, "cold_cpu_share": args.share, "cold_prefetch": args.prefetch,
               "cold_warm": args.warm}
    text = (f"# Half-cold decode side by sides\n\nWritten by `python bench/side_by_sides.py` from the side by sides' "
            f"JSON under `{args.dir}`: medians over each side's samples, every run recorded (runs on a disturbed "
            f"host included; docs/benchmarks.md names them).\n\n" + report(runs, current, skipped))
    print(text, end="")
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
