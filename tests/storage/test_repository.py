import dataclasses
import uuid

import optuna
import pytest
import sqlalchemy
from sqlalchemy.exc import IntegrityError, OperationalError

from storage.database import Database, StorageError
from storage.records import HardwareRecord, MeasurementRecord, ProfileRecord, TelemetrySample
from storage.repository import Reader, Repository, hardware_key


def _hardware(**over):
    fields = dict(gpu_name="NVIDIA H200", gpu_uuid=f"GPU-{uuid.uuid4()}", gpu_driver="570.1",
                  gpu_vram_mb=143771, cpu="AMD EPYC", cpu_count=16, ram_mb=131072)
    fields.update(over)
    return HardwareRecord(key=hardware_key(**fields), **fields)


def _measurement(study, number=0, **over):
    m = MeasurementRecord(
        study=study, trial_number=number, phase="trial", attempt=0, status="complete",
        params={"draft": "none", "expert_budget_mb": 512}, decode_tok_s=41.5, ttft_s=0.25,
        peak_mem_mb=1234.0, metrics={"decode_tok_s": {"median": 41.5, "min": 40.0, "max": 43.0}},
        telemetry={"rss_max_mb": 900.0})
    return dataclasses.replace(m, **over)


def _samples(n):
    return [TelemetrySample(t_s=0.1 * i, cpu_pct=50.0 + i, rss_mb=800.0 + i,
                            ram_available_mb=20000.0, gpu_clock_reasons=0x40 if i == 1 else None)
            for i in range(n)]


def test_measurement_round_trip_with_samples(db_url, study_name):
    repo = Repository.open(db_url)
    hw = repo.hardware_id(_hardware())
    stored = repo.add_measurement(_measurement(study_name, hardware_id=hw), _samples(3))
    assert stored.id is not None and stored.created is not None

    (got,) = repo.measurements(study_name)
    assert got == stored
    assert got.metrics["decode_tok_s"]["max"] == 43.0
    assert got.params == {"draft": "none", "expert_budget_mb": 512}
    samples = repo.samples(got.id)
    assert samples == _samples(3)
    assert samples[1].gpu_clock_reasons == 0x40
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.status = "failed"


def test_failed_write_leaves_nothing_behind(db_url, study_name):
    repo = Repository.open(db_url)
    bad = [TelemetrySample(t_s=0.0, cpu_pct=None, rss_mb=1.0, ram_available_mb=1.0)]
    with pytest.raises(IntegrityError):
        repo.add_measurement(_measurement(study_name), bad)
    assert repo.measurements(study_name) == []
    repo.add_measurement(_measurement(study_name, number=1), _samples(1))
    assert [m.trial_number for m in repo.measurements(study_name)] == [1]


def test_hardware_fingerprint_is_stored_once(db_url):
    repo = Repository.open(db_url)
    hw = _hardware()
    first = repo.hardware_id(hw)
    assert repo.hardware_id(hw) == first
    other = repo.hardware_id(_hardware(gpu_driver="575.0"))
    assert other != first
    (row,) = repo.hardware(first)
    assert dataclasses.replace(row, id=None, first_seen=None) == hw


def test_profiles_and_measurement_filters(db_url, study_name):
    repo = Repository.open(db_url)
    for number in (0, 1, 1):
        repo.add_measurement(_measurement(study_name, number=number))
    assert len(repo.measurements(study_name, trial_number=1)) == 2
    p = repo.add_profile(ProfileRecord(study=study_name, trial_number=1, path="/x/profile.toml",
                                       sha256="ab" * 32, content="[profile]\n"))
    assert repo.profiles(study_name) == [p]
    assert repo.profiles("no-such-study") == []


def test_optuna_trials_are_flattened_with_constraints(db_url, study_name):
    repo = Repository.open(db_url)
    study = optuna.create_study(study_name=study_name, storage=repo.optuna_storage(),
                                directions=["maximize", "minimize"])
    study.set_metric_names(["decode_tok_s", "ttft_s"])
    for tok_s, ttft, over in [(10.0, 1.0, 0.0), (20.0, 2.0, 0.0), (30.0, 0.5, 5.0), (5.0, 3.0, 0.0)]:
        trial = study.ask()
        trial.suggest_int("spec_len", 1, 8)
        trial.set_constraint("vram_over_cap_mb", over)
        study.tell(trial, [tok_s, ttft])
    failed = study.ask()
    study.tell(failed, state=optuna.trial.TrialState.FAIL)

    trials = repo.trials(study_name)
    assert [t.state for t in trials] == ["COMPLETE"] * 4 + ["FAIL"]
    assert [t.feasible for t in trials] == [True, True, False, True, False]
    assert trials[2].constraints == {"vram_over_cap_mb": 5.0}
    assert trials[0].values == (10.0, 1.0)
    assert trials[0].duration_s is not None and trials[0].duration_s >= 0
    # (30, 0.5) dominates everything but is infeasible; (10, 1) and (20, 2) remain.
    assert sorted(t.number for t in repo.pareto_front(study_name)) == [0, 1]
    (summary,) = [s for s in repo.studies() if s.name == study_name]
    assert summary.directions == ("MAXIMIZE", "MINIMIZE")
    assert summary.objective_names == ("decode_tok_s", "ttft_s")
    assert summary.n_trials == 5


def test_sqlite_reader_cannot_write(tmp_path, study_name):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    Repository.open(url).add_measurement(_measurement(study_name))
    reader = Reader.open(url)
    assert len(reader.measurements(study_name)) == 1
    assert not hasattr(reader, "add_measurement")
    with pytest.raises(OperationalError, match="readonly"):
        with reader.db.engine.begin() as conn:
            conn.execute(sqlalchemy.text("DELETE FROM luce_measurements"))
    assert len(reader.measurements(study_name)) == 1


def test_bad_urls_are_one_sentence_errors(tmp_path):
    with pytest.raises(StorageError, match="not a database URL"):
        Database("no scheme here")
    with pytest.raises(StorageError, match="does not exist"):
        Reader.open(f"sqlite:///{tmp_path / 'missing.db'}")
    with pytest.raises(StorageError, match="needs a file path"):
        Database("sqlite://")
