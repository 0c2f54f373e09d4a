"""The only way in and out of the database: plain frozen records, one transaction per write.

``Reader`` is what the dashboard gets (it never writes); ``Repository`` adds the tuner's
writes. Optuna's trials are read through Optuna's public API and flattened.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, fields, replace
from typing import Any, Iterable, Sequence

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from storage import tables
from storage.database import Database
from storage.records import (
    HardwareRecord,
    MeasurementRecord,
    ProfileRecord,
    StudyRecord,
    TelemetrySample,
    TrialRecord,
)

_SAMPLE_FIELDS = [f.name for f in fields(TelemetrySample)]
_HARDWARE_FIELDS = [f.name for f in fields(HardwareRecord)]
_MEASUREMENT_FIELDS = [f.name for f in fields(MeasurementRecord)]
_PROFILE_FIELDS = [f.name for f in fields(ProfileRecord)]


def hardware_key(gpu_name: str, gpu_uuid: str, gpu_driver: str, gpu_vram_mb: int, cpu: str,
                 cpu_count: int, ram_mb: int) -> str:
    """A stable id for a fingerprint: sha256 of its fields in a fixed order."""
    text = "\x1f".join(str(v) for v in (gpu_name, gpu_uuid, gpu_driver, gpu_vram_mb, cpu,
                                          cpu_count, ram_mb))
    return hashlib.sha256(text.encode()).hexdigest()


class Reader:
    """Read-only access for the dashboard and the CLI's status views."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._optuna = None

    @classmethod
    def open(cls, url: str) -> "Reader":
        return cls(Database(url, read_only=True))

    def _storage(self):
        if self._optuna is None:
            self._optuna = self.db.optuna_storage()
        return self._optuna

    def studies(self) -> list[StudyRecord]:
        import optuna

        out = []
        for s in optuna.get_all_study_summaries(self._storage(), include_best_trial=False):
            study = optuna.load_study(study_name=s.study_name, storage=self._storage())
            out.append(StudyRecord(
                name=s.study_name,
                directions=tuple(d.name for d in s.directions),
                objective_names=tuple(study.metric_names or ()),
                n_trials=s.n_trials,
                user_attrs=dict(s.user_attrs),
            ))
        return out

    def study(self, name: str) -> StudyRecord | None:
        return next((s for s in self.studies() if s.name == name), None)

    def trials(self, study: str) -> list[TrialRecord]:
        import optuna

        loaded = optuna.load_study(study_name=study, storage=self._storage())
        return [_trial_record(study, t) for t in loaded.get_trials(deepcopy=False)]

    def pareto_front(self, study: str) -> list[TrialRecord]:
        """The feasible, non-dominated completed trials (Optuna's best_trials)."""
        import optuna

        loaded = optuna.load_study(study_name=study, storage=self._storage())
        return [_trial_record(study, t) for t in loaded.best_trials]

    def measurements(self, study: str, trial_number: int | None = None) -> list[MeasurementRecord]:
        q = select(tables.Measurement).where(tables.Measurement.study == study)
        if trial_number is not None:
            q = q.where(tables.Measurement.trial_number == trial_number)
        q = q.order_by(tables.Measurement.id)
        with self.db.session() as s:
            return [_record(MeasurementRecord, row, _MEASUREMENT_FIELDS) for row in s.scalars(q)]

    def samples(self, measurement_id: int) -> list[TelemetrySample]:
        q = (select(tables.Sample).where(tables.Sample.measurement_id == measurement_id)
             .order_by(tables.Sample.t_s, tables.Sample.id))
        with self.db.session() as s:
            return [_record(TelemetrySample, row, _SAMPLE_FIELDS) for row in s.scalars(q)]

    def hardware(self, hardware_id: int | None = None) -> list[HardwareRecord]:
        q = select(tables.Hardware).order_by(tables.Hardware.id)
        if hardware_id is not None:
            q = q.where(tables.Hardware.id == hardware_id)
        with self.db.session() as s:
            return [_record(HardwareRecord, row, _HARDWARE_FIELDS) for row in s.scalars(q)]

    def profiles(self, study: str | None = None) -> list[ProfileRecord]:
        q = select(tables.Profile).order_by(tables.Profile.id)
        if study is not None:
            q = q.where(tables.Profile.study == study)
        with self.db.session() as s:
            return [_record(ProfileRecord, row, _PROFILE_FIELDS) for row in s.scalars(q)]


class Repository(Reader):
    """The tuner's access: everything a Reader does, plus writes, each in one transaction."""

    @classmethod
    def open(cls, url: str) -> "Repository":
        return cls(Database(url))

    def optuna_storage(self, *, heartbeat_interval_s: int | None = None,
                       grace_s: int | None = None, on_stale=None):
        self._optuna = self.db.optuna_storage(
            heartbeat_interval_s=heartbeat_interval_s, grace_s=grace_s, on_stale=on_stale)
        return self._optuna

    def hardware_id(self, hw: HardwareRecord) -> int:
        """The id of this fingerprint, inserting it on first sight."""
        q = select(tables.Hardware.id).where(tables.Hardware.key == hw.key)
        for _ in range(2):
            with self.db.session() as s:
                found = s.scalar(q)
                if found is not None:
                    return found
            try:
                with self.db.session() as s:
                    row = tables.Hardware(**_columns(hw, exclude=("id", "first_seen")))
                    s.add(row)
                    s.flush()
                    return row.id
            except IntegrityError:  # another worker inserted it first
                continue
        raise RuntimeError(f"hardware fingerprint {hw.key} could neither be found nor inserted")

    def add_measurement(self, m: MeasurementRecord,
                        samples: Sequence[TelemetrySample] = ()) -> MeasurementRecord:
        """Store a measurement with its telemetry samples, all or nothing."""
        with self.db.session() as s:
            row = tables.Measurement(**_columns(m, exclude=("id", "created")))
            row.params, row.metrics, row.telemetry = dict(m.params), dict(m.metrics), dict(m.telemetry)
            s.add(row)
            s.flush()
            s.add_all(tables.Sample(measurement_id=row.id, **asdict(x)) for x in samples)
            s.flush()
            return replace(m, id=row.id, created=row.created)

    def add_profile(self, p: ProfileRecord) -> ProfileRecord:
        with self.db.session() as s:
            row = tables.Profile(**_columns(p, exclude=("id", "created")))
            s.add(row)
            s.flush()
            return replace(p, id=row.id, created=row.created)


def _columns(record: Any, exclude: Iterable[str]) -> dict[str, Any]:
    skip = set(exclude)
    return {f.name: getattr(record, f.name) for f in fields(record) if f.name not in skip}


def _record(cls: type, row: Any, names: list[str]) -> Any:
    return cls(**{n: getattr(row, n) for n in names})


def _trial_record(study: str, t: Any) -> TrialRecord:
    return TrialRecord(
        study=study,
        number=t.number,
        state=t.state.name,
        params=dict(t.params),
        values=tuple(t.values) if t.values is not None else None,
        constraints=dict(t.constraints),
        user_attrs=dict(t.user_attrs),
        started=t.datetime_start,
        finished=t.datetime_complete,
    )
