"""What every page shares in a browser session: the database, the chosen study, the settings."""

from __future__ import annotations

import os

import streamlit as st

from dashboard.data import READ_ERRORS, Source, StudyView, describe_error
from dashboard.settings import Settings

STUDY_KEY = "study"
LIVE_KEY = "live"


@st.cache_resource(show_spinner=False)
def _source(url: str) -> Source:
    return Source.open(url)


def settings() -> Settings:
    try:
        return Settings.from_env(os.environ)
    except ValueError as exc:
        st.error(f"Dashboard settings: {exc}.")
        st.stop()


def source() -> Source:
    """The shared read-only source; on a bad URL or file, an error message and the page stops."""
    url = settings().storage
    try:
        return _source(url)
    except READ_ERRORS as exc:
        st.error(f"Cannot open the study database: {describe_error(exc, url)}.")
        st.stop()


def sidebar() -> None:
    """Choose the study (default: ``?study=`` in the URL, else the newest) and live refresh."""
    src = source()
    try:
        names = [s.name for s in src.studies()]
    except READ_ERRORS as exc:
        st.error(f"Cannot read the study database: {describe_error(exc, src.display_url)}.")
        st.stop()
    st.sidebar.caption(f"Database: `{src.display_url}` (read-only)")
    if not names:
        st.info(f"No studies in {src.display_url} yet. Start one with `luce-tune run`; "
                "reload this page once it has begun.")
        st.stop()
    wanted = st.query_params.get(STUDY_KEY)
    if st.session_state.get(STUDY_KEY) not in names:
        st.session_state[STUDY_KEY] = wanted if wanted in names else names[-1]
    st.sidebar.selectbox("Study", names, key=STUDY_KEY)
    refresh = settings().refresh_s
    label = f"Live refresh (every {refresh:g} s)" if refresh > 0 else "Live refresh (off: --refresh 0)"
    st.sidebar.toggle(label, value=refresh > 0, key=LIVE_KEY, disabled=refresh == 0)


def study() -> StudyView:
    """The chosen study, read afresh; stops the page with a message when it cannot be read."""
    src = source()
    name = st.session_state.get(STUDY_KEY)
    try:
        view = src.study(name) if name else None
    except READ_ERRORS as exc:
        st.error(f"Cannot read study {name!r}: {describe_error(exc, src.display_url)}.")
        st.stop()
    if view is None:
        st.warning(f"Study {name!r} is not in {src.display_url} any more.")
        st.stop()
    return view


def refresh_every() -> float | None:
    """Seconds between live refreshes, None when off."""
    s = settings().refresh_s
    return s if s > 0 and st.session_state.get(LIVE_KEY, True) else None


def tok_s(value: float | None) -> str:
    return "\u2014" if value is None else f"{value:.1f}"


def ms(seconds: float | None) -> str:
    return "\u2014" if seconds is None else f"{seconds * 1e3:.1f} ms"
