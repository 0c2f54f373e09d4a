"""The data layer's rules, on records made by hand."""

from datetime import datetime

import pytest
from sqlalchemy.engine import make_url

from dashboard.settings import REFRESH_ENV, STORAGE_ENV, Settings
from dashboard.data import PG_READ_ONLY, read_only_url, trial_status
from storage.records import TrialRecord


def trial(state, constraints=None, **attrs):
    return TrialRecord(study="s", number=0, state=state, params={}, values=(1.0, 2.0) if state == "COMPLETE" else None,
                       constraints=constraints or {}, user_attrs=attrs, started=datetime(2026, 1, 1),
                       finished=None)


@pytest.mark.parametrize("record, status", [
    (trial("COMPLETE", {"vram_over_cap_mb": -10.0}), "complete"),
    (trial("COMPLETE", {"vram_over_cap_mb": 5.0, "greedy_mismatches": 0.0}), "infeasible"),
    (trial("FAIL", status="infeasible", failure="oom: CUDA out of memory"), "infeasible"),
    (trial("FAIL", status="failed", failure="timeout: no answer within 5 s"), "failed"),
    (trial("FAIL"), "failed"),  # a stale trial of a killed run
    (trial("RUNNING"), "running"),
    (trial("WAITING"), "waiting"),
])
def test_trial_status(record, status):
    assert trial_status(record) == status


def test_postgres_sessions_are_made_read_only():
    url = read_only_url("postgresql+psycopg://luce:secret@db.local:5432/studies?sslmode=require")
    u = make_url(url)
    assert u.query["options"] == PG_READ_ONLY and u.query["sslmode"] == "require"
    assert u.password == "secret"
    again = make_url(read_only_url(url))
    assert again.query["options"] == PG_READ_ONLY
    kept = make_url(read_only_url("postgresql+psycopg://h/db?options=-c%20search_path%3Dluce"))
    assert kept.query["options"] == f"-c search_path=luce {PG_READ_ONLY}"
    assert read_only_url("sqlite:///x.db") == "sqlite:///x.db"


def test_read_only_on_a_real_postgres_server():
    import os

    import optuna
    import sqlalchemy

    from dashboard.data import Source

    url = os.environ.get("LUCE_TUNE_TEST_PG_URL")
    if not url:
        pytest.skip("LUCE_TUNE_TEST_PG_URL is not set (.ci/postgres.sh prints one)")
    name = f"dashboard-{os.getpid()}"
    study = optuna.create_study(study_name=name, storage=url, directions=["maximize", "minimize"])
    study.add_trial(optuna.trial.create_trial(values=[10.0, 0.5]))
    source = Source.open(url)
    try:
        assert name in [s.name for s in source.studies()]
        assert source.study(name).trials[0].metrics["objective 0"] == 10.0
        with pytest.raises(sqlalchemy.exc.InternalError, match="read-only transaction"):
            with source.reader.db.engine.begin() as conn:
                conn.execute(sqlalchemy.text("CREATE TABLE dashboard_intruder (x INTEGER)"))
    finally:
        source.close()
        optuna.delete_study(study_name=name, storage=url)


def test_settings_from_the_environment():
    assert Settings.from_env({STORAGE_ENV: "sqlite:///a.db"}) == Settings("sqlite:///a.db", 5.0)
    assert Settings.from_env({STORAGE_ENV: "sqlite:///a.db", REFRESH_ENV: "0"}).refresh_s == 0.0
    with pytest.raises(ValueError, match="luce-tune dashboard --storage URL"):
        Settings.from_env({})
    with pytest.raises(ValueError, match="expected a number of seconds, found 'soon'"):
        Settings.from_env({STORAGE_ENV: "sqlite:///a.db", REFRESH_ENV: "soon"})
    with pytest.raises(ValueError, match="expected 0 or more seconds, found -1"):
        Settings("sqlite:///a.db", -1)
    settings = Settings("postgresql+psycopg://h/db", 2.5)
    assert Settings.from_env(settings.to_env()) == settings
