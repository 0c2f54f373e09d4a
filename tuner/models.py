"""The model files of a study: which exist, what they hash to, which the engine accepts."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from tuner.config import ApplianceConfig, ConfigError
from engine.profile import file_sha256
from tuner.protocol import Load, LoadSpec
from tuner.worker import EngineWorker, WorkerError

Warn = Callable[[str], None]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def experts_mb(target: Path, *, experts: str, dtype: str | None, gpu: bool) -> int:
    """The routed experts' size as a trial's engine holds them, in MB: the GGUF blocks' bytes
    when ``experts`` is "quantized", else their element count at the engine's dtype (``None``:
    bfloat16 on a GPU, float32 on the CPU), which for a quantized file is several times the
    file. The expert budget has nothing to place beyond it."""
    from engine.gguf.names import is_expert_tensor
    from engine.gguf.reader import GGUFFile

    width = DTYPE_BYTES[dtype or ("bfloat16" if gpu else "float32")]
    total = 0
    with GGUFFile(target) as f:
        for info in f.tensors.values():
            if not is_expert_tensor(info.name):
                continue
            total += info.nbytes if experts == "quantized" else math.prod(info.shape) * width
    return math.ceil(total / 2**20)


def present_models(c: ApplianceConfig, warn: Warn) -> ApplianceConfig:
    """The config with only the draft and drafter files that exist: a missing target is an
    error, a missing optional model a warning (its dimension of the search goes away)."""
    if not c.models.target.is_file():
        raise ConfigError(f"{c.source}: models.target: model file {c.models.target} does not exist")
    names = [p.name for p in c.models.drafts]
    if len(set(names)) != len(names):
        raise ConfigError(f"{c.source}: models.drafts: candidates must have distinct file names, "
                          f"found {names}")
    drafts = tuple(p for p in c.models.drafts if p.is_file())
    drafter = c.models.drafter if c.models.drafter is not None and c.models.drafter.is_file() else None
    missing = [p for p in c.models.drafts if p not in drafts]
    if c.models.drafter is not None and drafter is None:
        missing.append(c.models.drafter)
    for p in missing:
        warn(f"{p.name} is not used: model file {p} does not exist")
    return replace(c, models=replace(c.models, drafts=drafts, drafter=drafter))


def record_model_files(study: Any, c: ApplianceConfig) -> None:
    """Hash the model files once per study (kept with it, re-hashed only when size or mtime
    change) and refuse a resume whose files changed: its trials would not be comparable."""
    known = dict(study.user_attrs.get("model_files", {}))
    roles = {"target": c.models.target, "drafter": c.models.drafter,
             **{f"draft:{p.name}": p for p in c.models.drafts}}
    changed = False
    for role, path in roles.items():
        if path is None:
            continue
        st = path.stat()
        entry = known.get(role)
        if entry and entry["size"] == st.st_size and entry["mtime_ns"] == st.st_mtime_ns:
            continue
        sha = file_sha256(path)
        if entry and entry["sha256"] != sha:
            raise ConfigError(f"{c.source}: models: {path} changed since study {c.study.name!r} "
                              f"began (sha256 {sha[:12]}... instead of {entry['sha256'][:12]}...); "
                              "use another study.name")
        known[role] = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "sha256": sha}
        changed = True
    if changed:
        study.set_user_attr("model_files", known)


def probe_models(worker: EngineWorker, study: Any, c: ApplianceConfig,
                 warn: Warn) -> tuple[dict[str, Path], Path | None]:
    """The drafts (by file name) and drafter the engine accepts with this target.

    Each candidate is loaded once per study through the worker; the verdicts are kept with
    the study, so the search space stays the same when it resumes.
    """
    verdicts = dict(study.user_attrs.get("compatibility", {}))
    probes = [("drafter", c.models.drafter)] if c.models.drafter else []
    probes += [(f"draft:{p.name}", p) for p in c.models.drafts]
    probes = [(role, path) for role, path in probes if role not in verdicts]
    for role, path in probes:
        drafter = c.models.drafter if role == "drafter" or verdicts.get("drafter") == "" else None
        spec = LoadSpec(target=str(c.models.target),
                        draft=str(path) if role != "drafter" else None,
                        drafter=str(drafter) if drafter else None,
                        pflash_threshold=c.search.pflash_threshold,
                        device=c.hardware.device, dtype=c.hardware.dtype, threads=c.hardware.threads,
                        options=tuple(sorted(c.engine.load_options().items())))
        try:
            worker.request(Load(spec), timeout_s=c.study.load_timeout_s,
                           load_timeout_s=c.study.load_timeout_s)
            verdicts[role] = ""
        except WorkerError as exc:
            verdicts[role] = exc.reason
    if probes:
        study.set_user_attr("compatibility", verdicts)
    for role, reason in verdicts.items():
        if reason:
            warn(f"{role.removeprefix('draft:')} is not used: {reason}")
    drafter = c.models.drafter if verdicts.get("drafter") == "" else None
    drafts = {p.name: p for p in c.models.drafts if verdicts.get(f"draft:{p.name}") == ""}
    return drafts, drafter
