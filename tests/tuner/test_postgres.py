import collections
import os
import subprocess
import sys
import uuid

import optuna
import pytest
from optuna.trial import TrialState

from storage.repository import Reader
from tuner.config import load_config

from .conftest import FAKE
from .test_resume import RUN

PG_URL = os.environ.get("LUCE_TUNE_TEST_PG_URL")


@pytest.mark.skipif(not PG_URL, reason="LUCE_TUNE_TEST_PG_URL is not set (.ci/postgres.sh prints one)")
@pytest.mark.slow
def test_two_workers_share_one_postgres_study(appliance):
    name = f"two-workers-{uuid.uuid4().hex[:8]}"
    path = appliance(sections={"study": {"trials": 6, "name": name, "storage": PG_URL}},
                     behaviour={"ms_per_token": 40.0}, drafts=("draft.gguf",), drafter=None)
    cfg = load_config(path)
    workers = [subprocess.Popen([sys.executable, "-c", RUN, str(path), FAKE], cwd=os.getcwd(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    for w in workers:
        _, err = w.communicate(timeout=300)
        assert w.returncode == 0, err.decode()

    trials = optuna.load_study(study_name=name, storage=PG_URL).get_trials()
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    # Each worker stops once it sees six finished trials; both may have started one more.
    assert 6 <= len(done) <= 7 and len(done) == len(trials)
    by_worker = collections.Counter(t.user_attrs["worker"] for t in done)
    assert len(by_worker) == 2 and min(by_worker.values()) >= 1
    measured = collections.Counter(m.trial_number for m in Reader.open(PG_URL).measurements(name)
                                   if m.phase == "trial")
    assert sorted(measured) == sorted(t.number for t in done)
    assert set(measured.values()) == {1}  # no trial was measured twice
    assert cfg.publish.profile.exists()
