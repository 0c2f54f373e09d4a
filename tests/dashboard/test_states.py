"""The dashboard on every state a database can be in: missing, empty, wrong, in progress,
shared with a running tuner, and holding studies from several machines."""

import hashlib
import shutil
import sqlite3
import uuid
import warnings

import optuna
import pytest
import sqlalchemy

from dashboard.data import DashboardError, Source
from storage.records import HardwareRecord, MeasurementRecord, TelemetrySample
from storage.repository import Repository, hardware_key
from tests.dashboard.apptest import PAGES, chart, make_app, metrics, page_errors


def copy_db(study_db, tmp_path):
    """A private copy of the tuner-made database (with its WAL), safe to write to."""
    for suffix in ("", "-wal", "-shm"):
        src = study_db.path.with_name(study_db.path.name + suffix)
        if src.exists():
            shutil.copy(src, tmp_path / f"study.db{suffix}")
    return f"sqlite:///{tmp_path / 'study.db'}"


def test_a_missing_file_is_one_clear_message(tmp_path, monkeypatch):
    at = make_app(f"sqlite:///{tmp_path / 'nope.db'}", monkeypatch)
    assert not at.exception
    (error,) = at.error
    assert error.value == (f"Cannot open the study database: storage URL "
                           f"'sqlite:///{tmp_path / 'nope.db'}': database file "
                           f"{tmp_path / 'nope.db'} does not exist.")


@pytest.mark.parametrize("url, says", [
    ("not a url", "is not a database URL"),
    ("postgresql+psycopg://luce@127.0.0.1:9/none", "127.0.0.1"),
])
def test_a_wrong_url_is_one_clear_message(url, says, monkeypatch):
    at = make_app(url, monkeypatch)
    assert not at.exception
    (error,) = at.error
    assert error.value.startswith("Cannot") and says in error.value
    assert "Traceback" not in error.value and len(error.value.splitlines()) == 1


def test_a_file_that_is_not_a_database(tmp_path, monkeypatch):
    (tmp_path / "junk.db").write_bytes(b"not sqlite at all" * 100)
    at = make_app(f"sqlite:///{tmp_path / 'junk.db'}", monkeypatch)
    assert not at.exception
    assert "file is not a database" in at.error[0].value


@pytest.mark.parametrize("made_by", ["nothing", "storage"])
def test_an_empty_database_says_so_on_every_page(tmp_path, monkeypatch, made_by):
    path = tmp_path / "empty.db"
    if made_by == "nothing":
        sqlite3.connect(path).close()
    else:
        Repository.open(f"sqlite:///{path}").optuna_storage()  # the tables, no study
    for page in PAGES:
        at = make_app(f"sqlite:///{path}", monkeypatch, page=page)
        assert not page_errors(at)
        assert at.info[0].value.startswith(f"No studies in sqlite:///{path} yet.")


@pytest.mark.parametrize("directions", [["maximize", "minimize"], ["maximize"]])
@pytest.mark.parametrize("made_by", ["storage", "optuna alone"])
def test_a_study_just_begun_renders_every_page(tmp_path, monkeypatch, directions, made_by):
    url = f"sqlite:///{tmp_path / 'new.db'}"
    storage = Repository.open(url).optuna_storage() if made_by == "storage" else url
    study = optuna.create_study(study_name="new", storage=storage, directions=directions)
    study.ask()  # its first trial, still running
    for page in PAGES:
        at = make_app(url, monkeypatch, page=page)
        assert not page_errors(at), page
    overview = make_app(url, monkeypatch)
    assert metrics(overview)["Running"] == "1"
    assert any(i.value.startswith("No feasible trial yet") for i in overview.info)


def test_a_study_in_progress_shows_its_running_trial_and_new_results(study_db, tmp_path, monkeypatch):
    url = copy_db(study_db, tmp_path)
    writer = optuna.load_study(study_name="search", storage=url)
    running = writer.ask(writer.trials[0].distributions)
    at = make_app(url, monkeypatch, study="search")
    before = int(metrics(at)["Trials"])
    assert metrics(at)["Running"] == "1"
    assert any(f"Trial {running.number} is running" in i.value for i in at.info)
    table = make_app(url, monkeypatch, study="search", page="trials.py").dataframe[0].value
    assert table.set_index("trial").loc[running.number, "status"] == "running"

    writer.tell(running, state=optuna.trial.TrialState.FAIL)
    at.run()  # what a live refresh does: read the database again
    assert metrics(at)["Running"] == "0"
    assert metrics(at)["Trials"] == str(before)
    assert metrics(at)["Failed"] == "2"


def test_the_dashboard_never_writes(study_db, monkeypatch):
    files = sorted(study_db.path.parent.glob("study.db*"))
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.suffix != ".db-shm"}
    for page in PAGES:
        assert not page_errors(make_app(study_db.url, monkeypatch, study="search", page=page))
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.suffix != ".db-shm"}
    assert after == before
    source = Source.open(study_db.url)
    with pytest.raises(sqlalchemy.exc.OperationalError, match="readonly database"):
        with source.reader.db.engine.begin() as conn:
            conn.execute(sqlalchemy.text("CREATE TABLE intruder (x INTEGER)"))
    source.close()


def test_reading_does_not_block_the_tuner_writing(study_db, tmp_path):
    url = copy_db(study_db, tmp_path)
    source = Source.open(url)
    writer = optuna.load_study(study_name="search",
                               storage=optuna.storages.RDBStorage(url, engine_kwargs={
                                   "connect_args": {"timeout": 2}}))
    with source.reader.db.engine.connect() as conn:
        reading = conn.exec_driver_sql("SELECT number FROM trials")
        reading.fetchone()  # a read in progress holds its snapshot of the database
        trial = writer.ask(writer.trials[0].distributions)
        writer.tell(trial, [1.0, 2.0])
        reading.close()
    view = source.study("search")
    assert view.trial(trial.number).status == "complete"
    source.close()


@pytest.fixture
def two_machines(tmp_path):
    """Two studies measured on two GPU machines, written through storage's repository the way
    the tuner writes them, with GPU telemetry that throttled on one machine."""
    url = f"sqlite:///{tmp_path / 'machines.db'}"
    repo = Repository.open(url)
    storage = repo.optuna_storage()
    machines = {}
    for name, gpu, vram in (("h200-run", "NVIDIA H200", 143771), ("3090-run", "NVIDIA GeForce RTX 3090", 24576)):
        fields = dict(gpu_name=gpu, gpu_uuid=f"GPU-{uuid.uuid4()}", gpu_driver="570.86",
                      gpu_vram_mb=vram, cpu="AMD EPYC 9334", cpu_count=16, ram_mb=131072)
        hw = HardwareRecord(key=hardware_key(**fields), **fields)
        machines[name] = (hw, repo.hardware_id(hw))
    results = {"h200-run": [(267.0, 0.21), (281.5, 0.25)], "3090-run": [(112.0, 0.60)]}
    for name, points in results.items():
        study = optuna.create_study(study_name=name, storage=storage,
                                    directions=["maximize", "minimize"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(["decode_tok_s", "ttft_s"])
        hw, hw_id = machines[name]
        for i, (tok_s, ttft) in enumerate(points):
            trial = study.ask({"expert_budget_mb": optuna.distributions.IntDistribution(0, 8192, step=256)})
            trial.set_user_attr("hardware", hw.key)
            study.tell(trial, [tok_s, ttft])
            samples = [TelemetrySample(t_s=0.5 * k, cpu_pct=30.0, rss_mb=2000.0, ram_available_mb=90000.0,
                                       gpu_mem_mb=15000.0 + 100 * k, gpu_power_w=300.0 + k,
                                       gpu_temp_c=70.0 + k, gpu_sm_clock_mhz=1980.0 - 10 * k,
                                       gpu_util_pct=95.0, gpu_clock_reasons=0x40 if k >= 3 else 0)
                       for k in range(6)]
            repo.add_measurement(MeasurementRecord(
                study=name, trial_number=trial.number, phase="trial", attempt=0, status="complete",
                params=trial.params, decode_tok_s=tok_s, ttft_s=ttft, peak_mem_mb=15500.0,
                throttled=name == "3090-run", hardware_id=hw_id), samples)
    repo.db.close()
    return url, machines, results


def test_studies_compared_across_machines(two_machines, monkeypatch):
    url, machines, results = two_machines
    at = make_app(url, monkeypatch, page="hardware.py")
    assert not page_errors(at)
    table = at.dataframe[0].value.set_index("study")
    assert table.loc["h200-run", "gpu"] == "NVIDIA H200"
    assert table.loc["3090-run", "gpu"] == "NVIDIA GeForce RTX 3090"
    assert table.loc["h200-run", "best decode tok/s"] == 281.5
    assert table.loc["3090-run", "best TTFT ms"] == pytest.approx(600.0)
    assert table.loc["h200-run", "fingerprint"] == machines["h200-run"][0].key[:12]
    assert "on 2 machines" in at.caption[0].value
    bars = chart(at, "hardware_chart")["data"]
    assert sorted(b["name"] for b in bars) == sorted(table["machine"])


def test_gpu_telemetry_and_throttle_flags(two_machines, monkeypatch):
    url, _, _ = two_machines
    at = make_app(url, monkeypatch, study="3090-run", page="telemetry.py")
    assert not page_errors(at)
    assert metrics(at)["Throttled"] == "yes"
    lines = chart(at, "telemetry_timelines")["data"]
    names = [d["name"] for d in lines]
    assert names[:5] == ["GPU memory (MB)", "GPU power (W)", "GPU temperature (C)", "SM clock (MHz)",
                         "GPU utilisation (%)"]
    assert lines[0]["y"] == pytest.approx([15000.0 + 100 * k for k in range(6)])
    (flags,) = chart(at, "telemetry_throttle")["data"]
    assert flags["name"] == "HW thermal slowdown"
    assert flags["x"] == pytest.approx([1.5, 2.0, 2.5])


def test_source_errors_are_dashboard_errors(tmp_path):
    with pytest.raises(DashboardError, match="does not exist"):
        Source.open(f"sqlite:///{tmp_path / 'missing.db'}")
    with pytest.raises(DashboardError, match="is not a database URL"):
        Source.open("://")
