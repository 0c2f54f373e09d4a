"""Published profiles: the winner's settings, what they measured, and where they hold.

A profile is TOML with a checksum over its content, written atomically. Reading it back
refuses a torn or edited file; ``verify_profile`` compares it with the machine and the
model files at boot. Only the standard library and tomli-w are used here, so the engine can
share this code without depending on the tuner's machinery.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import tomli_w

from engine.errors import ConfigError

SCHEMA = 1
ENGINE_KEYS = ("device", "dtype", "threads", "expert_budget_mb", "pflash_threshold", "spec_len", "spec_lookup",
               "pflash_keep_ratio", "weights", "cold_format", "hot_format", "cuda_graph", "cold_device",
               "cold_cpu_share", "placement_unit", "cold_prefetch", "cold_warm")
LOAD_KEYS = ("device", "dtype", "threads", "expert_budget_mb", "pflash_threshold", "weights", "cold_format",
             "hot_format", "cuda_graph", "cold_device", "cold_cpu_share", "placement_unit", "cold_prefetch",
             "cold_warm")
GENERATE_KEYS = ("spec_len", "spec_lookup", "pflash_keep_ratio")
SPEC_LOOKUP_MAX = 16  # engine.dflash.lookup.MAX_MIN_MATCH (not imported: this module stays free of torch)
MODEL_ROLES = ("target", "draft", "drafter")
FINGERPRINT_KEYS = ("gpu_name", "gpu_uuid", "gpu_driver", "gpu_vram_mb", "cpu", "cpu_count", "ram_mb")


class ProfileError(ConfigError):
    """A profile that cannot be trusted: unreadable, torn, edited or of another schema."""


@dataclass(frozen=True)
class ModelEntry:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Profile:
    study: str
    trial: int
    created: str  # ISO 8601, UTC
    luce_tune_version: str
    engine: Mapping[str, Any]  # the knobs, ENGINE_KEYS; absent keys are the engine's defaults
    models: Mapping[str, ModelEntry]  # "target" always, "draft" and "drafter" when used
    hardware: Mapping[str, Any]  # the fingerprint, FINGERPRINT_KEYS
    metrics: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # median/low/high/n
    schema: int = SCHEMA

    def __post_init__(self) -> None:
        unknown = set(self.engine) - set(ENGINE_KEYS)
        if unknown:
            raise ValueError(f"engine.{sorted(unknown)[0]} is not a known setting")
        if "target" not in self.models or set(self.models) - set(MODEL_ROLES):
            raise ValueError(f"models must name the target and only {', '.join(MODEL_ROLES)}, "
                             f"found {sorted(self.models)}")
        missing = set(FINGERPRINT_KEYS) - set(self.hardware)
        if missing:
            raise ValueError(f"hardware.{sorted(missing)[0]} is missing")
        if "spec_lookup" in self.engine:  # absent in older profiles: the engine's default, off
            lookup = self.engine["spec_lookup"]
            if isinstance(lookup, bool) or not isinstance(lookup, int) or not 0 <= lookup <= SPEC_LOOKUP_MAX:
                raise ValueError(f"engine.spec_lookup: expected a match length from 0 (off) to {SPEC_LOOKUP_MAX}, "
                                 f"found {lookup!r}")
            if "draft" not in self.models:
                raise ValueError(f"engine.spec_lookup {lookup} is set without a draft (models.draft)")

    def load_options(self) -> dict[str, Any]:
        """Keyword arguments for ``Engine.from_gguf(models['target'].path, **...)``."""
        out = {k: self.engine[k] for k in LOAD_KEYS if k in self.engine}
        for role in ("draft", "drafter"):
            if role in self.models:
                out[role] = self.models[role].path
        return out

    def generate_options(self) -> dict[str, Any]:
        """Keyword arguments for ``engine.generate``."""
        return {k: self.engine[k] for k in GENERATE_KEYS if k in self.engine}

    def content(self) -> dict[str, Any]:
        return {
            "profile": {"schema": self.schema, "study": self.study, "trial": self.trial,
                        "created": self.created, "luce_tune_version": self.luce_tune_version},
            "engine": dict(self.engine),
            "metrics": {k: dict(v) for k, v in self.metrics.items()},
            "hardware": dict(self.hardware),
            "models": {role: {"path": m.path, "size": m.size, "sha256": m.sha256}
                       for role, m in self.models.items()},
        }


def checksum(content: Mapping[str, Any]) -> str:
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def render_profile(profile: Profile) -> str:
    content = profile.content()
    content["profile"]["checksum"] = checksum(content)
    return tomli_w.dumps(content)


def write_profile(path: str | Path, profile: Profile) -> str:
    """Write atomically (temporary file, fsync, rename, fsync of the folder); returns the text."""
    path = Path(path)
    text = render_profile(profile)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return text


def load_profile(path: str | Path) -> Profile:
    """Read a profile, refusing anything torn, edited or malformed with a ProfileError."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"{path}: profile not found") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read the profile: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: not valid TOML (torn or edited?): {exc}") from None
    head = raw.get("profile")
    if not isinstance(head, dict) or "checksum" not in head:
        raise ProfileError(f"{path}: [profile] checksum is missing (torn or not a profile)")
    stored = head.pop("checksum")
    if stored != checksum(raw):
        raise ProfileError(f"{path}: checksum {stored!r} does not match the content "
                           "(the profile was edited or torn)")
    if head.get("schema") != SCHEMA:
        raise ProfileError(f"{path}: profile.schema is {head.get('schema')!r}, expected {SCHEMA}")
    try:
        models = {role: ModelEntry(path=str(m["path"]), size=int(m["size"]), sha256=str(m["sha256"]))
                  for role, m in raw["models"].items()}
        return Profile(study=str(head["study"]), trial=int(head["trial"]),
                       created=str(head["created"]), luce_tune_version=str(head["luce_tune_version"]),
                       engine=dict(raw["engine"]), models=models, hardware=dict(raw["hardware"]),
                       metrics={k: dict(v) for k, v in raw.get("metrics", {}).items()})
    except KeyError as exc:
        raise ProfileError(f"{path}: key {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise ProfileError(f"{path}: {exc}") from None


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def model_entry(path: str | Path) -> ModelEntry:
    p = Path(path).resolve()
    return ModelEntry(path=str(p), size=p.stat().st_size, sha256=file_sha256(p))


def model_hashes(profile: Profile) -> dict[str, str | None]:
    """sha256 of each model file the profile names, as found now (None: missing or another
    size, which is cheaper to see than a hash)."""
    out: dict[str, str | None] = {}
    for role, m in profile.models.items():
        p = Path(m.path)
        try:
            out[role] = file_sha256(p) if p.stat().st_size == m.size else None
        except OSError:
            out[role] = None
    return out


def verify_profile(profile: Profile, fingerprint: Mapping[str, Any],
                   model_hashes: Mapping[str, str | None]) -> list[str]:
    """Every way this machine and these files differ from the profile's; empty when it holds."""
    problems = []
    for key in FINGERPRINT_KEYS:
        want, found = profile.hardware.get(key), fingerprint.get(key)
        if want != found:
            problems.append(f"hardware.{key} is {found!r} here, the profile was measured on {want!r}")
    for role, m in profile.models.items():
        found = model_hashes.get(role)
        if found is None:
            problems.append(f"models.{role}: {m.path} is missing or not {m.size} bytes")
        elif found != m.sha256:
            problems.append(f"models.{role}: {m.path} has sha256 {found[:12]}..., "
                            f"the profile expects {m.sha256[:12]}...")
    return problems
