"""The project's own tables, beside Optuna's in the same database (names start with luce_)."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Hardware(Base):
    __tablename__ = "luce_hardware"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(64), unique=True)
    gpu_name: Mapped[str] = mapped_column(String(256))
    gpu_uuid: Mapped[str] = mapped_column(String(128))
    gpu_driver: Mapped[str] = mapped_column(String(64))
    gpu_vram_mb: Mapped[int] = mapped_column(Integer)
    cpu: Mapped[str] = mapped_column(String(256))
    cpu_count: Mapped[int] = mapped_column(Integer)
    ram_mb: Mapped[int] = mapped_column(Integer)
    first_seen: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class Measurement(Base):
    __tablename__ = "luce_measurements"
    __table_args__ = (Index("ix_luce_measurements_study_trial", "study", "trial_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study: Mapped[str] = mapped_column(String(512))
    trial_number: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    params: Mapped[dict] = mapped_column(JSON)
    decode_tok_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    ttft_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    peak_mem_mb: Mapped[float | None] = mapped_column(Float, nullable=True)
    throttled: Mapped[bool] = mapped_column(Boolean, default=False)
    metrics: Mapped[dict] = mapped_column(JSON)
    telemetry: Mapped[dict] = mapped_column(JSON)
    hardware_id: Mapped[int | None] = mapped_column(ForeignKey("luce_hardware.id"), nullable=True)
    created: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class Sample(Base):
    __tablename__ = "luce_telemetry_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    measurement_id: Mapped[int] = mapped_column(
        ForeignKey("luce_measurements.id", ondelete="CASCADE"), index=True)
    t_s: Mapped[float] = mapped_column(Float)
    cpu_pct: Mapped[float] = mapped_column(Float)
    rss_mb: Mapped[float] = mapped_column(Float)
    ram_available_mb: Mapped[float] = mapped_column(Float)
    cgroup_mem_mb: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_mem_mb: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_power_w: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_energy_j: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_temp_c: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_sm_clock_mhz: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_util_pct: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_clock_reasons: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class Profile(Base):
    __tablename__ = "luce_profiles"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study: Mapped[str] = mapped_column(String(512), index=True)
    trial_number: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    content: Mapped[str] = mapped_column(Text)
    hardware_id: Mapped[int | None] = mapped_column(ForeignKey("luce_hardware.id"), nullable=True)
    created: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
