"""How close does the tuner's study get to an exhaustive coarse grid, and after how many trials?

    python bench/grid_vs_study.py [--config appliance.toml] [--trials 12] [--budget-points 4]
        [--budget-step-mb N] [--db runs/grid.db [--only grid|study]] [--json out.json]

Runs two studies of one appliance config into one fresh SQLite database: ``grid`` measures
every point of ``SearchSpace.coarse_grid`` (budget x draft x spec_len x keep ratio), and
``study`` runs the tuner as ``luce-tune run`` would (warm start, then TPE) for ``--trials``.
Reports the best feasible decode tok/s of each, and the study's best-so-far after each
trial as a share of the grid's best, then each study's telemetry: measurements, samples,
peak GPU memory, power and temperature, throttled measurements. ``--db`` keeps the database
(studies, trials, measurements and samples) for the dashboard; by default it is temporary.
``--only grid`` then ``--only study`` on one ``--db`` split the two over two runs; the second
prints the comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from storage.repository import Reader
from tuner.config import load_config
from tuner.study import Tuner


def telemetry_summary(url: str, study: str) -> dict:
    """What the telemetry sampler recorded for one study's measurements."""
    reader = Reader.open(url)
    measurements = reader.measurements(study)
    samples = [s for m in measurements if m.id is not None for s in reader.samples(m.id)]

    def peak(field: str) -> float | None:
        values = [getattr(s, field) for s in samples if getattr(s, field) is not None]
        return round(max(values), 1) if values else None

    return {"measurements": len(measurements), "samples": len(samples),
            "throttled": sum(m.throttled for m in measurements),
            "peak_gpu_mem_mb": peak("gpu_mem_mb"), "peak_power_w": peak("gpu_power_w"),
            "peak_temp_c": peak("gpu_temp_c"), "peak_rss_mb": peak("rss_mb")}


def measured(url: str, study: str) -> list[dict]:
    """A study's trials as stored, in trial order: parameters, status, decode tok/s (the last
    attempt of each trial's measurement; re-measurements left out)."""
    rows: dict[int, dict] = {}
    for m in Reader.open(url).measurements(study):
        if m.phase == "trial":
            rows[m.trial_number] = {"trial": m.trial_number, "params": dict(m.params), "status": m.status,
                                    "reason": m.reason, "decode_tok_s": m.decode_tok_s}
    return [rows[k] for k in sorted(rows)]


def best_so_far(rows: list[dict]) -> list[float]:
    """Best feasible decode tok/s after each trial."""
    best, out = 0.0, []
    for r in rows:
        if r["status"] == "complete" and r["decode_tok_s"] is not None:
            best = max(best, r["decode_tok_s"])
        out.append(best)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("appliance.toml"))
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--budget-points", type=int, default=4)
    ap.add_argument("--budget-step-mb", type=int, default=None,
                    help="the expert budget's step (default: the config's); a small target needs a small one")
    ap.add_argument("--db", type=Path, default=None,
                    help="keep the studies here; with --only, the other part may already be in it")
    ap.add_argument("--only", choices=("grid", "study"), default=None,
                    help="run one part (into --db), for machines whose calls are too short for both")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.only and args.db is None:
        raise SystemExit("--only needs --db: the other part is read from it")

    base = load_config(args.config)
    if args.budget_step_mb is not None:
        base = dataclasses.replace(base, search=dataclasses.replace(
            base.search, expert_budget_step_mb=args.budget_step_mb))
    parts = [args.only] if args.only else ["grid", "study"]
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db if args.db is not None else Path(tmp) / "grid.db"
        url = f"sqlite:///{db}"
        if db.exists():
            present = {s.name for s in Reader.open(url).studies()}
            if present & set(parts):
                raise SystemExit(f"{db} already holds {sorted(present & set(parts))}: give a new file")

        def run(name: str, trials: int | None, points=None):
            study = dataclasses.replace(base.study, storage=url, name=name, trials=trials,
                                        timeout_s=None if trials else 3600.0)
            publish = dataclasses.replace(base.publish, profile=Path(tmp) / f"{name}.toml")
            cfg = dataclasses.replace(base, study=study, publish=publish)
            return Tuner(cfg, points=points).run()

        if "grid" in parts:
            run("grid", None, lambda space: space.coarse_grid(args.budget_points))  # exactly the grid's points
        if "study" in parts:
            run("study", args.trials)
        present = {s.name for s in Reader.open(url).studies()}
        rows = {name: measured(url, name) for name in ("grid", "study") if name in present}
        telemetry = {name: telemetry_summary(url, name) for name in rows}
    for name, t in telemetry.items():
        print(f"telemetry, {name}: " + ", ".join(f"{k} {v}" for k, v in t.items()))
    for name, rs in rows.items():
        done = [r for r in rs if r["status"] == "complete" and r["decode_tok_s"] is not None]
        if done:
            top = max(done, key=lambda r: r["decode_tok_s"])
            print(f"{name}: {len(rs)} trials; best {top['decode_tok_s']:.2f} tok/s at {top['params']}")
        for r in rs:
            if r["status"] != "complete":
                print(f"{name} trial {r['trial']} {r['status']}: {r['reason'][:160]}")
    report: dict = {"telemetry": telemetry, **rows}
    if "grid" in rows and "study" in rows:
        grid_best = max(best_so_far(rows["grid"]), default=0.0)
        curve = best_so_far(rows["study"])
        reached = [b / grid_best if grid_best else 0.0 for b in curve]
        first = next((i + 1 for i, r in enumerate(reached) if r >= 0.95), None)
        print(f"study: best {curve[-1] if curve else 0:.2f} tok/s, {reached[-1] if reached else 0:.0%} of the "
              f"grid's best {grid_best:.2f}; >= 95% of it after {first if first else 'no'} trial(s)")
        print("best so far / grid best, per trial: " + " ".join(f"{r:.0%}" for r in reached))
        report.update(grid_best=grid_best, study_curve=curve, reached=reached, first_within_5pct=first)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
