"""How close does the tuner's study get to an exhaustive coarse grid, and after how many trials?

    python bench/grid_vs_study.py [--config appliance.toml] [--trials 12] [--budget-points 4]
        [--budget-step-mb N] [--db runs/grid.db] [--json out.json]

Runs two studies of one appliance config into one fresh SQLite database: ``grid`` measures
every point of ``SearchSpace.coarse_grid`` (budget x draft x spec_len x keep ratio), and
``study`` runs the tuner as ``luce-tune run`` would (warm start, then TPE) for ``--trials``.
Reports the best feasible decode tok/s of each, and the study's best-so-far after each
trial as a share of the grid's best, then each study's telemetry: measurements, samples,
peak GPU memory, power and temperature, throttled measurements. ``--db`` keeps the database
(studies, trials, measurements and samples) for the dashboard; by default it is temporary.
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


def best_so_far(outcomes) -> list[float]:
    """Best feasible decode tok/s (the first objective) after each trial."""
    best, out = 0.0, []
    for o in outcomes:
        if o.status == "complete" and o.values:
            best = max(best, o.values[0])
        out.append(best)
    return out


def point_row(outcome) -> dict:
    """One trial's parameters, status and objective values, for the JSON report."""
    return {"params": dataclasses.asdict(outcome.params), "status": outcome.status,
            "reason": outcome.reason, "values": list(outcome.values or ())}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("appliance.toml"))
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--budget-points", type=int, default=4)
    ap.add_argument("--budget-step-mb", type=int, default=None,
                    help="the expert budget's step (default: the config's); a small target needs a small one")
    ap.add_argument("--db", type=Path, default=None, help="keep the studies here (a fresh SQLite file)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    base = load_config(args.config)
    if args.budget_step_mb is not None:
        base = dataclasses.replace(base, search=dataclasses.replace(
            base.search, expert_budget_step_mb=args.budget_step_mb))
    if args.db is not None and args.db.exists():
        raise SystemExit(f"{args.db} exists: give a new file, the two studies' names are fixed")
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db if args.db is not None else Path(tmp) / "grid.db"
        url = f"sqlite:///{db}"

        def run(name: str, trials: int | None, points=None):
            study = dataclasses.replace(base.study, storage=url, name=name, trials=trials,
                                        timeout_s=None if trials else 3600.0)
            publish = dataclasses.replace(base.publish, profile=Path(tmp) / f"{name}.toml")
            cfg = dataclasses.replace(base, study=study, publish=publish)
            return Tuner(cfg, points=points).run()

        grid_points: list = []

        def grid(space):
            grid_points[:] = space.coarse_grid(args.budget_points)
            return grid_points

        grid_run = run("grid", None, grid)  # exactly the grid's points
        grid_best = max(best_so_far(grid_run.outcomes), default=0.0)
        study_run = run("study", args.trials)
        telemetry = {name: telemetry_summary(url, name) for name in ("grid", "study")}
    for name, t in telemetry.items():
        print(f"telemetry, {name}: " + ", ".join(f"{k} {v}" for k, v in t.items()))
    curve = best_so_far(study_run.outcomes)
    reached = [b / grid_best if grid_best else 0.0 for b in curve]
    first = next((i + 1 for i, r in enumerate(reached) if r >= 0.95), None)
    print(f"grid: {len(grid_points)} points, {len(grid_run.outcomes)} measured, best {grid_best:.2f} tok/s")
    print(f"study: {len(curve)} trials, best {curve[-1] if curve else 0:.2f} tok/s "
          f"({reached[-1] if reached else 0:.0%} of the grid's best); >= 95% of it after "
          f"{first if first else 'no'} trial(s)")
    for name, run_ in (("grid", grid_run), ("study", study_run)):
        done = [o for o in run_.outcomes if o.status == "complete" and o.values]
        if done:
            top = max(done, key=lambda o: o.values[0])
            print(f"{name}'s best: {top.values[0]:.2f} tok/s at {dataclasses.asdict(top.params)}")
        failed = [o for o in run_.outcomes if o.status != "complete"]
        for o in failed:
            print(f"{name} trial {o.number} {o.status}: {o.reason[:160]}")
    print("best so far / grid best, per trial: " + " ".join(f"{r:.0%}" for r in reached))
    if args.json:
        args.json.write_text(json.dumps({"grid_points": len(grid_points), "grid_best": grid_best,
                                         "study_curve": curve, "reached": reached,
                                         "first_within_5pct": first, "telemetry": telemetry,
                                         "grid": [point_row(o) for o in grid_run.outcomes],
                                         "study": [point_row(o) for o in study_run.outcomes]}, indent=1))


if __name__ == "__main__":
    main()
