import os
import uuid

import pytest

BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(params=BACKENDS)
def db_url(request, tmp_path):
    """The same suite runs on SQLite and, when LUCE_TUNE_TEST_PG_URL is set, on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    url = os.environ.get("LUCE_TUNE_TEST_PG_URL")
    if not url:
        pytest.skip("LUCE_TUNE_TEST_PG_URL is not set (.ci/postgres.sh prints one)")
    return url


@pytest.fixture
def study_name():
    return f"test-{uuid.uuid4().hex[:12]}"
