"""A study database made by the tuner itself, for the dashboard tests.

Two studies land in one SQLite file: ``cpu-real`` is the real engine on the shipped model
family (target and PFlash drafter from models/, on this machine's CPU: no budget dimension,
the PFlash keep ratio searched), ``search`` is the tuner's
search over drafts, spec_len and PFlash driven by the tuner's test engine (the fake engine
of tests/tuner), with a lossy draft (infeasible trials) and a hung trial (a failure).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAKE_ENGINE = "tests.tuner.fake_engine:FakeEngine.from_gguf"
SEARCH_TRIALS = 8
HUNG_TRIAL = 5
STUDIES = ("cpu-real", "search")


@dataclass(frozen=True)
class StudyDb:
    url: str
    path: Path
    root: Path  # the models, the database and the published profiles


@dataclass(frozen=True)
class Truth:
    """What the database holds, read through storage and Optuna directly (not the dashboard)."""

    trials: dict[str, list[Any]]  # study -> Optuna FrozenTrials
    fronts: dict[str, list[int]]  # study -> trial numbers on Optuna's Pareto front
    reader: Any  # storage.repository.Reader

    def feasible(self, study: str) -> list[Any]:
        return [t for t in self.trials[study] if t.state.name == "COMPLETE"
                and all(v <= 0 for v in t.constraints.values())]

    def best(self, study: str) -> Any:
        return max(self.feasible(study), key=lambda t: t.values[0])


def make_study_db(root: Path) -> StudyDb:
    path = root / "study.db"
    url = f"sqlite:///{path}"
    run_real_study(root, url)
    run_search_study(root, url)
    return StudyDb(url=url, path=path, root=root)


def read_truth(url: str) -> Truth:
    import optuna

    from storage.database import Database
    from storage.repository import Reader

    db = Database(url, read_only=True)
    storage = db.optuna_storage()
    studies = {name: optuna.load_study(study_name=name, storage=storage) for name in STUDIES}
    return Truth(trials={name: s.get_trials(deepcopy=True) for name, s in studies.items()},
                 fronts={name: sorted(t.number for t in s.best_trials) for name, s in studies.items()},
                 reader=Reader(db))


def _config(root: Path, raw: dict):
    from tuner.config import parse_config

    return parse_config(raw, root / "appliance.toml")


SHIPPED = Path(__file__).resolve().parents[2] / "models"


def run_real_study(root: Path, url: str) -> None:
    from tuner.study import Tuner

    Tuner(_config(root, {
        "models": {"target": str(SHIPPED / "luce-target.gguf"), "drafter": str(SHIPPED / "luce-drafter.gguf")},
        "hardware": {"device": "cpu", "threads": 1},
        "search": {"pflash_threshold": 96},
        "workload": {"code_prompts": 1, "long_form_prompts": 1, "niah_cases": 1, "long_prompt_tokens": 160,
                     "max_new_tokens": 4, "warmup": 0, "repeats": 2},
        "constraints": {"niah_min_accuracy": 0.0},  # the shipped target retrieves no needle yet
        "study": {"storage": url, "name": "cpu-real", "trials": 3, "trial_timeout_s": 120,
                  "load_timeout_s": 120, "remeasure_repeats": 2},
        "publish": {"profile": "cpu-real.toml"},
    })).run()


def run_search_study(root: Path, url: str) -> None:
    from engine.gguf.make_model import make_model
    from tuner.study import Tuner

    models = root / "search-models"
    models.mkdir()
    make_model(models / "target.gguf", "tiny", seed=4)
    for name in ("draft-a.gguf", "draft-b.gguf", "drafter.gguf"):
        (models / name).write_bytes(name.encode() * 100)
    (models / "target.gguf.fake.json").write_text(json.dumps({"lossy": ["draft-b.gguf"]}))
    Tuner(_config(root, {
        "models": {"target": "search-models/target.gguf",
                   "drafts": ["search-models/draft-a.gguf", "search-models/draft-b.gguf"],
                   "drafter": "search-models/drafter.gguf"},
        "hardware": {"device": "cpu"},
        "workload": {"code_prompts": 2, "long_form_prompts": 1, "niah_cases": 1,
                     "long_prompt_tokens": 64, "max_new_tokens": 4, "warmup": 0, "repeats": 2},
        "constraints": {"niah_min_accuracy": 0.0},
        "study": {"storage": url, "name": "search", "trials": SEARCH_TRIALS, "trial_timeout_s": 5,
                  "load_timeout_s": 60, "heartbeat_s": 1, "remeasure_repeats": 2},
        "publish": {"profile": "search.toml"},
    }), factory=FAKE_ENGINE, hang={HUNG_TRIAL: 60.0}).run()
