"""One database holds Optuna's tables and ours: SQLite by default, PostgreSQL by URL."""

from __future__ import annotations

import sqlite3
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import sqlalchemy
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.orm import Session

from storage.tables import Base

SQLITE_BUSY_TIMEOUT_S = 30


class StorageError(Exception):
    """The database cannot be opened or used; the message names the URL."""


class Database:
    """A database URL opened for the tuner (read-write) or for readers such as the dashboard.

    Every write goes through ``session()``, which commits on success and rolls back on any
    exception, so a killed process leaves only whole transactions behind.
    """

    def __init__(self, url: str, *, read_only: bool = False) -> None:
        try:
            self._url = make_url(url)
        except ArgumentError:
            raise StorageError(f"storage URL {url!r} is not a database URL "
                               "(expected sqlite:///path or postgresql+psycopg://...)") from None
        self.url = url
        self.read_only = read_only
        self.is_sqlite = self._url.get_backend_name() == "sqlite"
        self._kwargs = self._engine_kwargs()
        self.engine = sqlalchemy.create_engine(self._url, **self._kwargs)
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        if not read_only:
            self._retry(lambda: Base.metadata.create_all(self.engine), "create tables")

    @property
    def display_url(self) -> str:
        """The URL with any password hidden, for messages and logs."""
        return self._url.render_as_string(hide_password=True)

    def _engine_kwargs(self) -> dict[str, Any]:
        if not self.is_sqlite:
            return {"pool_pre_ping": True}
        path = self._url.database
        if not path or path == ":memory:":
            raise StorageError(f"storage URL {self.url!r}: an SQLite study needs a file path")
        if self.read_only:
            if not Path(path).is_file():
                raise StorageError(f"storage URL {self.url!r}: database file {path} does not exist")
            uri = Path(path).resolve().as_uri() + "?mode=ro"
            return {"creator": lambda: sqlite3.connect(uri, uri=True,
                                                       timeout=SQLITE_BUSY_TIMEOUT_S,
                                                       check_same_thread=False)}
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"storage URL {self.url!r}: cannot create folder "
                               f"{Path(path).parent}: {exc.strerror}") from None
        with sqlite3.connect(path, timeout=SQLITE_BUSY_TIMEOUT_S) as conn:
            # WAL lets readers (the dashboard) work while the tuner writes; it persists in the file.
            conn.execute("PRAGMA journal_mode=WAL")
        return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}}

    def _retry(self, action: Callable[[], Any], what: str) -> Any:
        # Processes starting together (workers, a dashboard) can race to create the same tables.
        for attempt in range(3):
            try:
                return action()
            except DBAPIError as exc:
                if attempt == 2:
                    raise StorageError(f"storage {self.display_url}: cannot {what}: "
                                       f"{_first_line(exc)}") from None
                time.sleep(0.5 * (attempt + 1))
        return None

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits when the block ends and rolls back if it raises."""
        with Session(self.engine, expire_on_commit=False) as session:
            try:
                yield session
                if self.read_only:
                    session.rollback()
                else:
                    session.commit()
            except BaseException:
                session.rollback()
                raise

    def optuna_storage(self, *, heartbeat_interval_s: int | None = None,
                       grace_s: int | None = None,
                       on_stale: Callable[..., None] | None = None):
        """Optuna's RDBStorage on the same database (tables created unless read-only)."""
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return self._retry(lambda: optuna.storages.RDBStorage(
                self._url.render_as_string(hide_password=False), engine_kwargs=dict(self._kwargs),
                heartbeat_interval=heartbeat_interval_s, grace_period=grace_s,
                heartbeat_stale_trial_callback=on_stale,
                skip_table_creation=self.read_only, skip_compatibility_check=self.read_only,
            ), "open Optuna's tables")

    def close(self) -> None:
        self.engine.dispose()


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000}")
    cursor.close()


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
