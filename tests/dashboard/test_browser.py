"""The dashboard as a person sees it: `luce-tune dashboard` serving the tuner-made database,
every page loaded in headless Chromium, a screenshot of each, and no error on any.

Screenshots go to the test's tmp_path and, when set, to $LUCE_TUNE_SCREENSHOT_DIR.
Skipped without Debian's `chromium` (.ci/chromium.sh installs it).
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dashboard.app import PAGES
from tests.dashboard.browser import Chromium

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT_ENV = "LUCE_TUNE_SCREENSHOT_DIR"
ERROR_MARKS = ('data-testid="stException"', 'data-testid="stAlertContentError"')


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(study_db, tmp_path):
    port = free_port()
    log = open(tmp_path / "dashboard.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "dashboard.command", "--storage", study_db.url,
                             "--port", str(port), "--refresh", "0"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read() == b"ok":
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the dashboard did not start: {(tmp_path / 'dashboard.log').read_text()}")
        time.sleep(0.3)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


@pytest.mark.slow
def test_every_page_in_a_browser(server, tmp_path):
    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("Debian's chromium is not installed (.ci/chromium.sh installs it)")
    extra = os.environ.get(SCREENSHOT_ENV)
    browser = Chromium(binary, tmp_path / "profile")
    # Every page on the searched study, and the real-engine study's overview.
    visits = [(page, "search") for page in PAGES] + [(PAGES[0], "cpu-real")]
    try:
        for (_, title, path), study in visits:
            shot = tmp_path / f"{path}-{study}.png"
            route = "" if path == PAGES[0][2] else path  # the default page lives at the root
            page = browser.load(f"{server}/{route}?study={study}", shot)
            assert shot.stat().st_size > 10_000, f"{shot} is nearly empty"
            assert title in page.text, f"{path}: the page title {title!r} is not shown"
            if route == "":
                assert f"\n{study}\n" in page.text, f"overview: study {study!r} is not the one shown"
            assert "Page not found" not in page.text, f"{path}: Streamlit does not know the page"
            assert "Traceback" not in page.text, f"{path}: a traceback is shown"
            for mark in ERROR_MARKS:
                assert mark not in page.dom, f"{path}?study={study}: the page shows an error"
            if extra:
                Path(extra).mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, Path(extra) / shot.name)
    finally:
        browser.close()
