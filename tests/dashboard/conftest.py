"""A study database made by the tuner itself, shared by the dashboard tests.

Two studies land in one SQLite file: ``cpu-real`` is the real engine on a tiny random model
(this machine's CPU, so no budget/draft/PFlash dimension yet), ``search`` is the tuner's
search over drafts, spec_len and PFlash driven by the tuner's test engine (the fake engine
of tests/tuner), with a lossy draft (infeasible trials) and a hung trial (a failure).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

FAKE_ENGINE = "tests.tuner.fake_engine:FakeEngine.from_gguf"
SEARCH_TRIALS = 8
HUNG_TRIAL = 5


@dataclass(frozen=True)
class StudyDb:
    url: str
    path: Path
    root: Path


def _config(root: Path, raw: dict):
    from tuner.config import parse_config

    return parse_config(raw, root / "appliance.toml")


def run_real_study(root: Path, url: str) -> None:
    from engine.gguf.make_model import make_model
    from tuner.study import Tuner

    make_model(root / "target.gguf", "tiny", seed=3)
    Tuner(_config(root, {
        "models": {"target": "target.gguf"},
        "hardware": {"device": "cpu", "threads": 1},
        "workload": {"code_prompts": 1, "long_form_prompts": 0, "niah_cases": 0,
                     "max_new_tokens": 4, "warmup": 0, "repeats": 2},
        "study": {"storage": url, "name": "cpu-real", "trials": 2, "trial_timeout_s": 120,
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


@pytest.fixture(scope="session")
def study_db(tmp_path_factory) -> StudyDb:
    root = tmp_path_factory.mktemp("dashboard-study")
    path = root / "study.db"
    url = f"sqlite:///{path}"
    run_real_study(root, url)
    run_search_study(root, url)
    return StudyDb(url=url, path=path, root=root)


@pytest.fixture(scope="session")
def truth(study_db):
    """What the database holds, read through storage and Optuna directly (not the dashboard)."""
    import optuna

    from storage.database import Database
    from storage.repository import Reader

    db = Database(study_db.url, read_only=True)
    storage = db.optuna_storage()
    studies = {name: optuna.load_study(study_name=name, storage=storage)
               for name in ("cpu-real", "search")}
    trials = {name: s.get_trials(deepcopy=True) for name, s in studies.items()}
    fronts = {name: sorted(t.number for t in s.best_trials) for name, s in studies.items()}
    reader = Reader(db)
    return Truth(trials=trials, fronts=fronts, reader=reader)


@dataclass(frozen=True)
class Truth:
    trials: dict
    fronts: dict
    reader: object

    def feasible(self, study):
        return [t for t in self.trials[study] if t.state.name == "COMPLETE"
                and all(v <= 0 for v in t.constraints.values())]

    def best(self, study):
        return max(self.feasible(study), key=lambda t: t.values[0])


def make_app(url: str, monkeypatch, *, study: str | None = None, page: str | None = None):
    """Run the dashboard in Streamlit's AppTest on ``url``, optionally on one study and page."""
    from streamlit.testing.v1 import AppTest

    from dashboard.context import STORAGE_ENV

    monkeypatch.setenv(STORAGE_ENV, url)
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py"),
                           default_timeout=60)
    if study is not None:
        at.query_params["study"] = study
    at.run()
    if page is not None:
        at.switch_page(page).run()
    return at
