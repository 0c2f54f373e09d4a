import pytest

from tests.dashboard.seed import make_study_db, read_truth


@pytest.fixture(scope="session")
def study_db(tmp_path_factory):
    """Two studies the tuner ran into one SQLite file (see seed.py): about 45 s, once."""
    return make_study_db(tmp_path_factory.mktemp("dashboard-study"))


@pytest.fixture(scope="session")
def truth(study_db):
    return read_truth(study_db.url)
