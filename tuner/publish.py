"""Choosing, re-measuring and publishing the winner as a profile."""

from __future__ import annotations

import hashlib
import tomllib
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import optuna
from optuna.trial import TrialState

from storage.records import ProfileRecord
from storage.repository import Repository
from tuner.config import ApplianceConfig, ConfigError
from tuner.metrics import TrialMetrics
from engine.profile import FINGERPRINT_KEYS, ModelEntry, Profile, write_profile
from tuner.space import KNOBS, TrialParams

if TYPE_CHECKING:
    from tuner.study import Outcome, Tuner


def luce_tune_version() -> str:
    """The installed package's version; run from a source tree that is not installed, the
    tree's ``pyproject.toml`` version marked ``+source``; "unknown" when neither is found."""
    try:
        return metadata.version("luce-tune")
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        return f"{tomllib.loads(pyproject.read_text())['project']['version']}+source"
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def publish_winner(t: "Tuner") -> tuple["Outcome | None", Path | None]:
    """Re-measure the best feasible trial against the runner-up (trials measured on this
    machine only) and publish whichever wins the first objective."""
    c = t.config
    maximize = c.objectives.directions[0] == "maximize"
    trials = [tr for tr in t.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
              if tr.user_attrs.get("hardware") == t.hardware_key
              and all(v <= 0 for v in tr.constraints.values())]
    if not trials:
        t.observer.warn("no feasible trial on this machine yet: nothing to publish")
        return None, None
    trials.sort(key=lambda tr: tr.values[0], reverse=maximize)
    finalists = [trials[0]]
    for tr in trials[1:]:
        if tr.params != trials[0].params:
            finalists.append(tr)
            break
    t.observer.remeasuring([tr.number for tr in finalists])
    remeasured = [t.measure(tr.number, t.space.params_of(tr.params), phase="remeasure",
                             repeats=c.study.remeasure_repeats) for tr in finalists]
    feasible = [o for o in remeasured if o.feasible]
    if not feasible:
        t.observer.warn("the finalists failed their re-measurement: nothing published")
        return None, None
    feasible.sort(key=lambda o: o.values[0], reverse=maximize)
    winner = feasible[0]
    runner_up = feasible[1] if len(feasible) > 1 else None
    metrics = profile_metrics(winner.metrics)
    if runner_up is not None:
        metrics["runner_up"] = {"trial": runner_up.number, c.objectives.metrics[0]: runner_up.values[0]}
    profile = build_profile(c, t.study.user_attrs["model_files"], winner.number, winner.params,
                            metrics, winner.device, t.hardware.fingerprint.as_dict())
    path = c.publish.profile
    text = write_profile(path, profile)
    record_profile(t.repo, c.study.name, winner.number, path, text, t.hardware_id)
    return winner, path


def profile_metrics(m: TrialMetrics) -> dict[str, dict[str, float]]:
    out = {"decode_tok_s": _stat(m.decode_tok_s), "ttft_s": _stat(m.ttft_s),
           "peak_mem_mb": {"max": m.peak_mem_mb}}
    if m.niah_accuracy is not None:
        out["niah_accuracy"] = {"mean": m.niah_accuracy}
    for key, value in m.extras.items():
        out[key] = {"mean": value}
    return out


def _stat(s: Any) -> dict[str, float]:
    return {"median": s.median, "low": s.low, "high": s.high, "n": s.n}


def build_profile(c: ApplianceConfig, model_files: Mapping[str, Any], number: int,
                  params: TrialParams, metrics: Mapping[str, Any], device: str,
                  fingerprint: Mapping[str, Any]) -> Profile:
    """``model_files`` is the study's record of the files it measured (path, size, sha256)."""
    engine: dict[str, Any] = {"device": device or c.hardware.device}
    if c.hardware.dtype is not None:
        engine["dtype"] = c.hardware.dtype
    if c.hardware.threads is not None:
        engine["threads"] = c.hardware.threads
    engine.update(c.engine.load_options())
    engine.update({k: v for k, v in params.as_dict().items() if k != "draft"})  # the draft is a model entry
    models = {"target": _entry(model_files["target"])}
    if params.draft is not None:
        models["draft"] = _entry(model_files[f"draft:{params.draft}"])
    if params.pflash_keep_ratio is not None:
        models["drafter"] = _entry(model_files["drafter"])
        if c.search.pflash_threshold is not None:
            engine["pflash_threshold"] = c.search.pflash_threshold
    return Profile(study=c.study.name, trial=number,
                   created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   luce_tune_version=luce_tune_version(), engine=engine, models=models,
                   hardware=dict(fingerprint), metrics={k: dict(v) for k, v in metrics.items()})


def _entry(f: Mapping[str, Any]) -> ModelEntry:
    return ModelEntry(path=f["path"], size=int(f["size"]), sha256=f["sha256"])


def record_profile(repo: Repository, study: str, number: int, path: Path, text: str,
                   hardware_id: int | None) -> None:
    repo.add_profile(ProfileRecord(study=study, trial_number=number, path=str(path),
                                   sha256=hashlib.sha256(text.encode()).hexdigest(),
                                   content=text, hardware_id=hardware_id))


def export_trial(c: ApplianceConfig, number: int, out: Path) -> Path:
    """Publish a chosen trial of the config's study from what was measured (no new run):
    its latest complete measurement, on the machine that measured it."""
    from storage.database import StorageError

    try:
        repo = Repository.open(c.study.storage)
        study = optuna.load_study(study_name=c.study.name, storage=repo.optuna_storage())
    except StorageError as exc:
        raise ConfigError(f"{c.source}: study.storage: {exc}") from None
    except KeyError:
        raise ConfigError(f"{c.source}: study.name: no study {c.study.name!r} in "
                          f"{repo.db.display_url}") from None
    trial = next((tr for tr in study.get_trials(deepcopy=False) if tr.number == number), None)
    if trial is None or trial.state != TrialState.COMPLETE:
        state = "does not exist" if trial is None else f"is {trial.state.name}"
        raise ConfigError(f"trial {number} of study {c.study.name!r} {state}; "
                          "only completed trials can be exported")
    done = [m for m in repo.measurements(c.study.name, number) if m.status == "complete"]
    if not done:
        raise ConfigError(f"trial {number} of study {c.study.name!r} has no feasible measurement")
    m = done[-1]
    (hw,) = repo.hardware(m.hardware_id)
    fingerprint = {k: getattr(hw, k) for k in FINGERPRINT_KEYS}
    stats = {k: m.metrics[k] for k in ("decode_tok_s", "ttft_s")}
    metrics = {k: {"median": v["median"], "low": v["low"], "high": v["high"], "n": v["n"]}
               for k, v in stats.items()}
    metrics["peak_mem_mb"] = {"max": m.metrics["peak_mem_mb"]}
    for key, value in m.metrics.get("extras", {}).items():
        metrics[key] = {"mean": value}
    params = TrialParams(**{k: m.params.get(k) for k in KNOBS})
    profile = build_profile(c, study.user_attrs["model_files"], number, params, metrics,
                            m.metrics.get("device", ""), fingerprint)
    text = write_profile(out, profile)
    record_profile(repo, c.study.name, number, out, text, m.hardware_id)
    return out
