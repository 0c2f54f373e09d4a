"""The dashboard's settings. ``luce-tune dashboard`` hands them to the Streamlit process through
the environment; this module imports nothing heavy, so the command can use it without Streamlit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

STORAGE_ENV = "LUCE_TUNE_DASHBOARD_STORAGE"
REFRESH_ENV = "LUCE_TUNE_DASHBOARD_REFRESH_S"


@dataclass(frozen=True)
class Settings:
    storage: str
    refresh_s: float = 5.0  # live refresh of the overview; 0 turns it off

    def __post_init__(self) -> None:
        if not self.storage.strip():
            raise ValueError(f"storage: expected a database URL, found {self.storage!r}")
        if self.refresh_s < 0:
            raise ValueError(f"refresh_s: expected 0 or more seconds, found {self.refresh_s}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Settings":
        storage = env.get(STORAGE_ENV, "")
        if not storage:
            raise ValueError(f"no study database given ({STORAGE_ENV} is not set): start the "
                             "dashboard with `luce-tune dashboard --storage URL`")
        text = env.get(REFRESH_ENV, "5")
        try:
            refresh = float(text)
        except ValueError:
            raise ValueError(f"{REFRESH_ENV}: expected a number of seconds, found {text!r}") from None
        return cls(storage=storage, refresh_s=refresh)

    def to_env(self) -> dict[str, str]:
        return {STORAGE_ENV: self.storage, REFRESH_ENV: str(self.refresh_s)}
