"""What the dashboard reads: storage's plain records and Optuna's read API, never a write.

SQLite is opened with ``mode=ro`` (storage's read-only Database); PostgreSQL sessions are
made read-only by the server (``default_transaction_read_only``), so a bug here can never
touch a running study.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import sqlalchemy
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from storage.database import StorageError
from storage.records import (
    HardwareRecord,
    MeasurementRecord,
    ProfileRecord,
    StudyRecord,
    TelemetrySample,
    TrialRecord,
)
from storage.repository import Reader

STATUSES = ("complete", "infeasible", "failed", "running", "waiting", "pruned")
MIN_IMPORTANCE_TRIALS = 4
FAILURE_ATTR = "failure"  # the tuner's user attr holding why it failed a trial
PG_READ_ONLY = "-c default_transaction_read_only=on"


class DashboardError(Exception):
    """The study database cannot be read; the message is one sentence naming it."""


@dataclass(frozen=True)
class TrialView:
    """A trial with what the pages show about it, resolved once."""

    record: TrialRecord
    status: str  # one of STATUSES
    reason: str  # why it failed or is infeasible; empty otherwise
    metrics: Mapping[str, float | None]  # decode_tok_s, ttft_s and every objective by name
    on_front: bool

    @property
    def number(self) -> int:
        return self.record.number

    @property
    def params(self) -> Mapping[str, Any]:
        return self.record.params


@dataclass(frozen=True)
class StudyView:
    study: StudyRecord
    trials: tuple[TrialView, ...]
    measurements: tuple[MeasurementRecord, ...]

    @property
    def objectives(self) -> tuple[str, ...]:
        names = self.study.objective_names
        return names if names else tuple(f"objective {i}" for i in range(len(self.study.directions)))

    def count(self, status: str) -> int:
        return sum(1 for t in self.trials if t.status == status)

    @property
    def best(self) -> TrialView | None:
        """The feasible trial best on the first objective: the one the tuner would publish."""
        done = [t for t in self.trials if t.status == "complete"
                and t.metrics.get(self.objectives[0]) is not None]
        if not done:
            return None
        sign = -1.0 if self.study.directions[0] == "MAXIMIZE" else 1.0
        return min(done, key=lambda t: (sign * t.metrics[self.objectives[0]], not t.on_front, t.number))

    def trial(self, number: int) -> TrialView | None:
        return next((t for t in self.trials if t.number == number), None)


@dataclass(frozen=True)
class Comparison:
    """One study's results on one machine."""

    study: str
    hardware: HardwareRecord | None
    trials: int
    feasible: int
    best_decode_tok_s: float | None
    best_ttft_s: float | None


def read_only_url(url: str) -> str:
    """``url`` with PostgreSQL sessions forced read-only; other URLs unchanged."""
    try:
        u = make_url(url)
    except ArgumentError:
        return url  # storage names the bad URL
    if u.get_backend_name() != "postgresql":
        return url
    options = u.query.get("options", "")
    if isinstance(options, tuple):
        options = " ".join(options)
    if PG_READ_ONLY not in options:
        u = u.update_query_dict({"options": f"{options} {PG_READ_ONLY}".strip()})
    return u.render_as_string(hide_password=False)


class Source:
    """A read-only view of one study database."""

    def __init__(self, reader: Reader, display_url: str) -> None:
        self.reader = reader
        self.display_url = display_url  # as the user gave it, password hidden
        self._optuna_storage: Any = None

    @classmethod
    def open(cls, url: str) -> "Source":
        try:
            reader = Reader.open(read_only_url(url))
        except StorageError as exc:
            raise DashboardError(str(exc)) from None
        except ImportError as exc:
            raise DashboardError(f"storage URL {url!r} needs the database driver {exc.name!r}, "
                                 "which is not installed (pip install 'luce-tune[postgres]')") from None
        return cls(reader, make_url(url).render_as_string(hide_password=True))

    def _has(self, table: str) -> bool:
        return sqlalchemy.inspect(self.reader.db.engine).has_table(table)

    def studies(self) -> list[StudyRecord]:
        """Every study, oldest first; none when the tuner has not created its tables yet."""
        return self.reader.studies() if self._has("studies") else []

    def measurements(self, study: str) -> list[MeasurementRecord]:
        """The study's measurements; none in a database that only Optuna has written."""
        return self.reader.measurements(study) if self._has("luce_measurements") else []

    def study(self, name: str) -> StudyView | None:
        record = self.reader.study(name)
        if record is None:
            return None
        measurements = tuple(self.measurements(name))
        try:
            front = {t.number for t in self.reader.pareto_front(name)}
        except ValueError:  # a single-objective study before its first completed trial
            front = set()
        views = tuple(_trial_view(record, t, measurements, t.number in front)
                      for t in self.reader.trials(name))
        return StudyView(study=record, trials=views, measurements=measurements)

    def samples(self, measurement_id: int) -> list[TelemetrySample]:
        return self.reader.samples(measurement_id)

    def hardware(self) -> dict[int, HardwareRecord]:
        return {h.id: h for h in self.reader.hardware()} if self._has("luce_hardware") else {}

    def profiles(self, study: str | None = None) -> list[ProfileRecord]:
        return self.reader.profiles(study) if self._has("luce_profiles") else []

    def comparisons(self) -> list[Comparison]:
        """Each study's best measured results per machine, from the trials' measurements."""
        machines = self.hardware()
        out = []
        for study in self.studies():
            rows = [m for m in self.measurements(study.name) if m.phase == "trial"]
            for hw_id in sorted({m.hardware_id for m in rows}, key=lambda h: (h is None, h or 0)):
                mine = [m for m in rows if m.hardware_id == hw_id]
                done = [m for m in mine if m.status == "complete"]
                decode = [m.decode_tok_s for m in done if m.decode_tok_s is not None]
                ttft = [m.ttft_s for m in done if m.ttft_s is not None]
                out.append(Comparison(
                    study=study.name, hardware=machines.get(hw_id) if hw_id is not None else None,
                    trials=len({m.trial_number for m in mine}),
                    feasible=len({m.trial_number for m in done}),
                    best_decode_tok_s=max(decode) if decode else None,
                    best_ttft_s=min(ttft) if ttft else None))
        return out

    def importance(self, study: str, objective: int) -> tuple[dict[str, float] | None, str]:
        """Optuna's parameter importances for one objective, or None and why not."""
        import optuna

        loaded = optuna.load_study(study_name=study, storage=self._storage())
        complete = loaded.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if len(complete) < MIN_IMPORTANCE_TRIALS:
            return None, (f"Parameter importance needs at least {MIN_IMPORTANCE_TRIALS} completed "
                          f"trials; this study has {len(complete)} so far.")
        varied = {k for t in complete for k in t.params
                  if len({repr(u.params.get(k)) for u in complete}) > 1}
        if not varied:
            return None, "No parameter has taken more than one value yet: nothing to rank."
        # PED-ANOVA ranks what makes a target small: maximised objectives are negated.
        sign = -1.0 if loaded.directions[objective].name == "MAXIMIZE" else 1.0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # PED-ANOVA warns below ~50 trials
                ranked = optuna.importance.get_param_importances(
                    loaded, target=lambda t: sign * t.values[objective])
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:
            return None, f"Optuna could not rank the parameters: {exc}"
        if not ranked:
            return None, ("No parameter is shared by every completed trial yet (conditional "
                          "parameters count only where all trials have them).")
        return dict(ranked), ""

    def _storage(self) -> Any:
        if self._optuna_storage is None:
            self._optuna_storage = self.reader.db.optuna_storage()
        return self._optuna_storage

    def close(self) -> None:
        self.reader.db.close()


def trial_status(t: TrialRecord) -> str:
    if t.state == "COMPLETE":
        return "complete" if t.feasible else "infeasible"
    if t.state == "FAIL":
        return "infeasible" if t.user_attrs.get("status") == "infeasible" else "failed"
    return t.state.lower()


def _trial_view(study: StudyRecord, t: TrialRecord, measurements: tuple[MeasurementRecord, ...],
                on_front: bool) -> TrialView:
    own = [m for m in measurements if m.trial_number == t.number and m.phase == "trial"]
    last = own[-1] if own else None
    metrics: dict[str, float | None] = {
        "decode_tok_s": last.decode_tok_s if last else None,
        "ttft_s": last.ttft_s if last else None,
    }
    names = study.objective_names or tuple(f"objective {i}" for i in range(len(study.directions)))
    if t.values is not None:
        metrics.update(zip(names, t.values))
    status = trial_status(t)
    reason = ""
    if status == "infeasible" and t.values is not None:
        over = [f"{k} (+{v:g})" for k, v in t.constraints.items() if v > 0]
        reason = "violates " + ", ".join(over) if over else ""
    if status in ("failed", "infeasible") and not reason:
        reason = str(t.user_attrs.get(FAILURE_ATTR) or (last.reason if last else "")
                     or "no reason recorded (the run stopped during this trial)")
    return TrialView(record=t, status=status, reason=reason, metrics=metrics, on_front=on_front)


def describe_error(exc: BaseException, url: str) -> str:
    """One sentence for a database that cannot be read."""
    if isinstance(exc, (DashboardError, StorageError)):
        return str(exc)
    text = str(getattr(exc, "orig", None) or exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return f"cannot read the study database {url}: {first}"


READ_ERRORS = (DashboardError, StorageError, SQLAlchemyError, OSError)
