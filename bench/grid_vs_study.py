"""How close does the tuner's study get to an exhaustive coarse grid, and after how many trials?

    python bench/grid_vs_study.py [--config appliance.toml] [--trials 12] [--json out.json]

Runs two studies of one appliance config into one fresh SQLite database: ``grid`` measures
every point of ``SearchSpace.coarse_grid`` (budget x draft x spec_len x keep ratio), and
``study`` runs the tuner as ``luce-tune run`` would (warm start, then TPE) for ``--trials``.
Reports the best feasible decode tok/s of each, and the study's best-so-far after each
trial as a share of the grid's best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("appliance.toml"))
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--budget-points", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    base = load_config(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'grid.db'}"

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
    curve = best_so_far(study_run.outcomes)
    reached = [b / grid_best if grid_best else 0.0 for b in curve]
    first = next((i + 1 for i, r in enumerate(reached) if r >= 0.95), None)
    print(f"grid: {len(grid_points)} points, {len(grid_run.outcomes)} measured, best {grid_best:.2f} tok/s")
    print(f"study: {len(curve)} trials, best {curve[-1] if curve else 0:.2f} tok/s "
          f"({reached[-1] if reached else 0:.0%} of the grid's best); >= 95% of it after "
          f"{first if first else 'no'} trial(s)")
    print("best so far / grid best, per trial: " + " ".join(f"{r:.0%}" for r in reached))
    if args.json:
        args.json.write_text(json.dumps({"grid_points": len(grid_points), "grid_best": grid_best,
                                         "study_curve": curve, "reached": reached,
                                         "first_within_5pct": first}, indent=1))


if __name__ == "__main__":
    main()
