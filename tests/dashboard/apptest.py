"""Running the dashboard in Streamlit's AppTest and reading what its pages show."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np

from dashboard import app

APP = Path(app.__file__)
PAGES = tuple(file for file, _, _ in app.PAGES)  # the page files, in the sidebar's order


def make_app(url: str, monkeypatch, *, study: str | None = None, page: str | None = None):
    """Run the dashboard on ``url``, optionally on one study (``?study=``) and page."""
    from streamlit.testing.v1 import AppTest

    from dashboard.settings import STORAGE_ENV

    monkeypatch.setenv(STORAGE_ENV, url)
    at = AppTest.from_file(str(APP), default_timeout=60)
    if study is not None:
        at.query_params["study"] = study
    at.run()
    if page is not None:
        at.switch_page(page).run()
    return at


def page_errors(at) -> list[str]:
    return [e.value for e in at.exception] + [e.value for e in at.error]


def metrics(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def decoded(value: Any) -> Any:
    """Plotly's JSON with its typed arrays ({"dtype", "bdata"}) turned back into lists."""
    if isinstance(value, dict) and "bdata" in value:
        a = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        if "shape" in value:
            a = a.reshape([int(n) for n in value["shape"].split(",")])
        return a.tolist()
    if isinstance(value, dict):
        return {k: decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decoded(v) for v in value]
    return value


def chart(at, key: str) -> dict:
    """The traces of the plotly chart the page drew with ``key``."""
    found = [c for c in at.get("plotly_chart") if c.proto.id.endswith(f"-{key}")]
    assert found, f"no chart {key!r} on the page"
    return {"data": decoded(json.loads(found[0].proto.spec)["data"])}
