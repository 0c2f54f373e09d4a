import os
import signal
import sqlite3
import subprocess
import sys
import time

import optuna
import psutil
from optuna.trial import TrialState

from tuner.config import load_config
from tuner.study import Tuner

from .conftest import FAKE

RUN = ("import sys; from tuner.config import load_config; from tuner.study import Tuner; "
       "Tuner(load_config(sys.argv[1]), factory=sys.argv[2]).run()")


def _trials(cfg):
    return optuna.load_study(study_name=cfg.study.name, storage=cfg.study.storage).get_trials()


def _states(db_file):
    """Trial states read with plain SQL, so that polling never writes to the database; a
    running trial is "ASKED" until its parameters are chosen."""
    try:
        with sqlite3.connect(f"file:{db_file}?mode=ro", uri=True) as db:
            rows = db.execute("SELECT t.state, COUNT(p.param_id) FROM trials t "
                              "LEFT JOIN trial_params p ON p.trial_id = t.trial_id GROUP BY t.trial_id")
            return [state if state != "RUNNING" or n_params else "ASKED" for state, n_params in rows]
    except sqlite3.OperationalError:  # no file or no tables yet
        return []


def test_kill_9_loses_no_finished_trial_and_the_next_run_resumes(appliance, tmp_path):
    path = appliance(sections={"study": {"trials": 4}, "workload": {"repeats": 2}},
                     behaviour={"ms_per_token": 80.0}, drafts=("draft.gguf",), drafter=None)
    cfg = load_config(path)
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(path), FAKE], cwd=os.getcwd(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:  # two trials done, a third being measured
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the study made no progress"
            states = _states(tmp_path / "study.db")
            if states.count("COMPLETE") >= 2 and "RUNNING" in states:
                break
            time.sleep(0.2)
        workers = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    before = {t.number: t for t in _trials(cfg)}
    finished = {n: t.values for n, t in before.items() if t.state == TrialState.COMPLETE}
    (running,) = [n for n, t in before.items() if t.state == TrialState.RUNNING]
    assert len(finished) >= 2
    # The worker notices its tuner is gone and exits on its own.
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive

    time.sleep(3.5)  # past the heartbeat grace period (3 heartbeats of 1 s)
    result = Tuner(cfg, factory=FAKE).run()

    after = {t.number: t for t in _trials(cfg)}
    for n, values in finished.items():
        assert after[n].state == TrialState.COMPLETE and after[n].values == values
    assert after[running].state == TrialState.FAIL and "failure" not in after[running].user_attrs
    retries = [t for t in after.values() if t.user_attrs.get("retry_of") == running]
    # The retry measures the killed trial's point: the parameters it had chosen (a kill can
    # land between two suggestions, so the rest are chosen afresh).
    assert len(retries) == 1 and after[running].params
    assert after[running].params.items() <= retries[0].params.items()
    assert sum(t.state == TrialState.COMPLETE for t in after.values()) == 4
    assert result.profile is not None and result.profile.exists()
    with sqlite3.connect(tmp_path / "study.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
