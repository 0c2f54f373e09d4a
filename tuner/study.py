"""The tuning service: an Optuna study driven by ask/tell against the engine worker.

Every finished trial is told to Optuna (and its measurements written) before the next one
starts, so killing the run loses at most the trial in flight; a new run fails that trial
once its heartbeat is stale, queues its parameters again and carries on to the trial count.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import optuna
from optuna.trial import TrialState

from engine.hardware import Hardware, Nvml, cuda_available, detect_hardware
from storage.database import StorageError
from storage.records import HardwareRecord, MeasurementRecord
from storage.repository import Repository, hardware_key
from tuner.config import ApplianceConfig, ConfigError
from tuner.jobs import Workload, build_workload
from tuner.metrics import TrialMetrics, aggregate, constraints
from tuner.models import experts_mb, present_models, probe_models, record_model_files
from tuner.observer import RunObserver
from tuner.protocol import LoadSpec, Measure, Measured
from tuner.space import SearchSpace, TrialParams
from tuner.telemetry import TelemetrySampler, TelemetrySummary
from tuner.worker import ENGINE_FACTORY, EngineWorker, WorkerError

FAILURE_ATTR = "failure"  # user attr of trials this service failed on purpose, with the reason


class TrialDurations:
    """The slowest trial timed so far among those that found the worker warm, and among the
    cold ones: what decides whether another trial fits in the run's time limit."""

    def __init__(self) -> None:
        self.warm = 0.0
        self.cold = 0.0

    def add(self, seconds: float, *, cold: bool) -> None:
        if cold:
            self.cold = max(self.cold, seconds)
        else:
            self.warm = max(self.warm, seconds)

    def fits(self, remaining_s: float, finals: float) -> bool:
        """Whether the next trial and the final re-measurement (``finals`` trials' worth of
        repeats) fit in ``remaining_s``, judged by the slowest warm trial. While only cold
        trials are timed, their duration bounds the next trial alone: it was mostly loading
        and compilation, which neither the next warm trial nor the re-measurement pays again
        (the re-measurement may then overrun the limit by at most its own warm length)."""
        if self.warm > 0:
            return self.warm * (1 + finals) <= remaining_s
        return self.cold <= remaining_s


@dataclass(frozen=True)
class Outcome:
    """One measured point: what the study was told and why."""

    number: int
    params: TrialParams
    status: str  # "complete", "failed" or "infeasible"
    reason: str = ""
    values: tuple[float, ...] | None = None
    constraints: Mapping[str, float] | None = None
    metrics: TrialMetrics | None = None
    telemetry: TelemetrySummary | None = None
    device: str = ""

    @property
    def feasible(self) -> bool:
        return (self.status == "complete" and self.constraints is not None
                and all(v <= 0 for v in self.constraints.values()))


@dataclass(frozen=True)
class RunResult:
    study: str
    outcomes: tuple[Outcome, ...]  # the trials this run measured
    winner: Outcome | None  # the re-measured winner, when a feasible trial exists
    profile: Path | None


class Tuner:
    """Runs one study for one appliance config. ``factory`` names the engine constructor the
    worker calls; ``hang`` maps trial numbers to seconds the worker sleeps (a test hook)."""

    def __init__(self, config: ApplianceConfig, *, observer: RunObserver | None = None,
                 factory: str = ENGINE_FACTORY, hang: Mapping[int, float] | None = None,
                 points: Callable[[SearchSpace], Sequence[TrialParams]] | None = None) -> None:
        """``points``, given the search space, names the trials to run in place of the warm
        start and the sampler (an exhaustive grid, say): the study then measures exactly those."""
        self.config = config
        self.points = points
        self.n_points: int | None = None
        self.observer = observer or RunObserver()
        self.factory = factory
        self.hang = dict(hang or {})
        self.worker = EngineWorker(factory)
        self.nvml: Nvml | None = None
        self.hardware: Hardware | None = None
        self.hardware_id: int | None = None
        self.hardware_key = ""
        self.repo: Repository | None = None
        self.storage: Any = None
        self.study: optuna.Study | None = None
        self.space: SearchSpace | None = None
        self.workload: Workload | None = None
        self.baseline: dict[str, list[int]] | None = None
        self.baseline_margins: dict[str, list[float]] | None = None  # top-2 gaps in ulps, per token
        self.drafts: dict[str, Path] = {}
        self.drafter: Path | None = None

    def run(self) -> RunResult:
        self.config = c = present_models(self.config, self.observer.warn)
        t_end = time.monotonic() + c.study.timeout_s if c.study.timeout_s else math.inf
        self.nvml = Nvml.open()
        try:
            with tempfile.TemporaryDirectory(prefix="luce-tune-") as scratch:
                self._open(Path(scratch))
                outcomes = self._loop(t_end)
                winner, profile = self._publish()
            return RunResult(study=c.study.name, outcomes=tuple(outcomes), winner=winner,
                             profile=profile)
        finally:
            self.worker.stop()
            if self.nvml is not None:
                self.nvml.close()

    def _open(self, scratch: Path) -> None:
        c = self.config
        self.hardware = detect_hardware(self.nvml, c.hardware.device,
                                        torch_cuda=self.nvml is not None and cuda_available())
        if c.hardware.device.startswith("cuda") and self.hardware.gpu is None:
            raise ConfigError(f"{c.source}: hardware.device is {c.hardware.device!r}, "
                              "but no usable CUDA GPU was found")
        try:
            self.repo = Repository.open(c.study.storage)
            self.storage = self.repo.optuna_storage(heartbeat_interval_s=c.study.heartbeat_s,
                                                    grace_s=3 * c.study.heartbeat_s,
                                                    on_stale=_requeue_stale)
        except StorageError as exc:
            raise ConfigError(f"{c.source}: study.storage: {exc}") from None
        fp = self.hardware.fingerprint.as_dict()
        self.hardware_key = hardware_key(**fp)
        self.hardware_id = self.repo.hardware_id(HardwareRecord(key=self.hardware_key, **fp))
        sampler = optuna.samplers.TPESampler(seed=c.study.seed, constant_liar=True,
                                             n_startup_trials=max(2, (c.study.trials or 10) // 3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.study = optuna.create_study(study_name=c.study.name, storage=self.storage,
                                             directions=list(c.objectives.directions),
                                             sampler=sampler, load_if_exists=True)
            names = self.study.metric_names
            directions = [d.name.lower() for d in self.study.directions]
            if directions != list(c.objectives.directions) or names not in (None, list(c.objectives.metrics)):
                raise ConfigError(
                    f"{c.source}: objectives.metrics: study {c.study.name!r} optimises "
                    f"{names or directions}, not {list(c.objectives.metrics)}; use another study.name")
            if names is None:
                self.study.set_metric_names(list(c.objectives.metrics))
            optuna.storages.fail_stale_trials(self.study)
        record_model_files(self.study, c)
        self.worker.start()
        self.drafts, self.drafter = probe_models(self.worker, self.study, c, self.observer.warn)
        self._build_space()
        self.observer.study_opened(self.study.study_name, self.hardware, self.space,
                                   finished=self._finished())
        from engine import Tokenizer

        try:
            self.workload = build_workload(c.workload, Tokenizer.from_gguf(c.models.target),
                                           scratch=scratch)
        except ValueError as exc:
            raise ConfigError(f"{c.source}: workload: {exc}") from None
        self._ensure_baseline()

    def _load_spec(self, draft: str | None = None) -> LoadSpec:
        h = self.config.hardware
        return LoadSpec(target=str(self.config.models.target),
                        draft=str(self.drafts[draft]) if draft else None,
                        drafter=str(self.drafter) if self.drafter else None,
                        pflash_threshold=self.config.search.pflash_threshold,
                        device=h.device, dtype=h.dtype, threads=h.threads,
                        options=tuple(sorted(self.config.engine.load_options().items())))

    def _build_space(self) -> None:
        c = self.config
        held_mb = experts_mb(c.models.target, experts=c.engine.experts, dtype=c.hardware.dtype,
                             gpu=self.hardware.gpu is not None and not c.hardware.device.startswith("cpu"))
        self.space = SearchSpace.build(c, self.hardware, drafts=tuple(self.drafts.values()),
                                       drafter_ok=self.drafter is not None, experts_mb=held_mb)
        stored = self.study.user_attrs.get("space")
        if stored is None:
            self.study.set_user_attr("space", self.space.describe())
            first = self.points(self.space) if self.points is not None else self.space.warm_start()
            if self.points is not None:
                self.n_points = len(first)
            for point in first:
                self.study.enqueue_trial(self.space.to_params(point), skip_if_exists=True)
        elif stored != self.space.describe():
            raise ConfigError(
                f"{c.source}: the search space {self.space.describe()} differs from the one study "
                f"{c.study.name!r} was created with ({stored}); use another study.name")

    def _ensure_baseline(self) -> None:
        """Greedy ids of plain decoding for the code prompts, what speculative decoding must
        reproduce, with each token's top-2 logit gap (where a difference is a numerical tie).
        Measured once per study and kept with it."""
        c = self.config
        if not (self.space.drafts and c.constraints.greedy_identical and self.workload.code_jobs):
            return
        stored = self.study.user_attrs.get("baseline")
        keys = sorted(j.key for j in self.workload.code_jobs)
        if stored is not None and sorted(stored) == keys:
            self.baseline = stored
            self.baseline_margins = self.study.user_attrs.get("baseline_margins")
            return
        top = self.space.warm_start()[0].expert_budget_mb
        request = Measure(spec=self._load_spec(), jobs=self.workload.code_jobs, expert_budget_mb=top,
                          warmup=0, repeats=1, seed=c.workload.seed, margins=True)
        try:
            reply = self.worker.request(request, timeout_s=c.study.trial_timeout_s,
                                        load_timeout_s=c.study.load_timeout_s)
        except WorkerError as exc:
            raise ConfigError(f"{c.source}: the greedy baseline (target alone, no draft) could not "
                              f"be measured: {exc.reason}") from None
        self.baseline = {o.key: list(o.ids) for o in reply.outputs}
        self.baseline_margins = {o.key: [round(m, 3) for m in o.margins] for o in reply.outputs}
        self.study.set_user_attr("baseline_margins", self.baseline_margins)
        self.study.set_user_attr("baseline", self.baseline)

    def _finished(self) -> int:
        """Trials that count toward the trial count: completed ones and those failed with a
        recorded reason (a stale trial of a killed run is retried instead)."""
        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
        return sum(1 for t in trials if t.state == TrialState.COMPLETE or FAILURE_ATTR in t.user_attrs)

    def _loop(self, t_end: float) -> list[Outcome]:
        """Trials until the count is reached, or until the next trial and the final
        re-measurement would no longer fit in the time limit (judged by the slowest trial).

        A trial that met a cold worker also paid the process start, the engine load and the
        GPU kernels' first compilation (minutes on a fresh machine at the 35B shapes), and so
        did the run's first trial (its settings' first graph capture and compilation). A cold
        trial's time bounds the next trial alone; once a warm trial has been timed, cold ones
        no longer set the estimate."""
        c = self.config
        target = 1 if self.space.is_empty else c.study.trials
        if self.n_points is not None:
            target = self.n_points
        outcomes = []
        durations = TrialDurations()
        finals = 2 * c.study.remeasure_repeats / c.workload.repeats
        while target is None or self._finished() < target:
            if not durations.fits(t_end - time.monotonic(), finals):
                break
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
                optuna.storages.fail_stale_trials(self.study)
                trial = self.study.ask()
            trial.set_user_attr("hardware", self.hardware_key)
            trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
            # The run's first trial is cold too: the baseline loaded the engine, but the
            # trial's settings (graph capture, budget moves) meet their kernels' first compilation.
            started, cold = time.monotonic(), self.worker.cold or not outcomes
            with _Heartbeat(self.storage, self.study.study_name, trial.number, c.study.heartbeat_s):
                try:
                    params = self.space.suggest(trial)
                    self.observer.trial_started(trial.number, params)
                    outcome = self.measure(trial.number, params, phase="trial",
                                           repeats=c.workload.repeats)
                except BaseException:
                    self.study.tell(trial, state=TrialState.FAIL)
                    raise
                self._tell(trial, outcome)
            durations.add(time.monotonic() - started, cold=cold)
            outcomes.append(outcome)
            self.observer.trial_finished(outcome, self._best())
        return outcomes

    def _tell(self, trial: optuna.Trial, o: Outcome) -> None:
        trial.set_user_attr("status", o.status)
        if o.device:
            trial.set_user_attr("device", o.device)
        if o.values is None:
            trial.set_user_attr(FAILURE_ATTR, o.reason)
            self.study.tell(trial, state=TrialState.FAIL)
            return
        for key, value in o.constraints.items():
            trial.set_constraint(key, value)
        if o.telemetry is not None and o.telemetry.throttled:
            trial.set_user_attr("throttled", True)
        for key, value in o.metrics.extras.items():
            trial.set_user_attr(key, value)
        if o.metrics.greedy_ties:
            trial.set_user_attr("greedy_ties", o.metrics.greedy_ties)
        self.study.tell(trial, list(o.values))

    def measure(self, number: int, params: TrialParams, *, phase: str, repeats: int) -> Outcome:
        """Measure ``params``; repeat while the GPU reported throttling, keep every attempt."""
        c = self.config
        request = Measure(spec=self._load_spec(params.draft), jobs=self.workload.jobs,
                          expert_budget_mb=params.expert_budget_mb, spec_len=params.spec_len,
                          spec_lookup=params.spec_lookup,
                          pflash_keep_ratio=params.pflash_keep_ratio, cold_cpu_share=params.cold_cpu_share,
                          placement_unit=params.placement_unit, cold_prefetch=params.cold_prefetch,
                          cold_warm=params.cold_warm,
                          warmup=c.workload.warmup,
                          repeats=repeats, seed=c.workload.seed,
                          hang_s=self.hang.get(number, 0.0) if phase == "trial" else 0.0)
        attempt = 0
        while True:
            outcome, samples = self._attempt(number, params, request)
            self.repo.add_measurement(self._record(number, phase, attempt, params, outcome), samples)
            if not (outcome.telemetry and outcome.telemetry.throttled) or attempt >= c.study.throttle_retries:
                return outcome
            attempt += 1
            self.observer.warn(f"trial {number} ran while the GPU throttled "
                               f"(reasons {outcome.telemetry.throttle_reasons:#x}): measuring again")

    def _attempt(self, number: int, params: TrialParams, request: Measure) -> tuple[Outcome, list]:
        c = self.config
        self.worker.ensure_started()
        gpu_index = self.hardware.gpu.nvml_index if self.hardware.gpu else None
        sampler = TelemetrySampler(pid=self.worker.pid, nvml=self.nvml, gpu_index=gpu_index,
                                   on_sample=self.observer.sample)
        sampler.start()
        try:
            reply: Measured = self.worker.request(request, timeout_s=c.study.trial_timeout_s,
                                                  load_timeout_s=c.study.load_timeout_s)
        except WorkerError as exc:
            summary = sampler.stop()
            status = "infeasible" if exc.kind == "oom" else "failed"
            return Outcome(number=number, params=params, status=status,
                           reason=f"{exc.kind}: {exc.reason}", telemetry=summary), sampler.samples
        summary = sampler.stop()
        metrics = aggregate(reply.outputs, baseline=self.baseline if params.draft else None,
                            baseline_margins=self.baseline_margins, tie_ulps=c.constraints.greedy_tie_ulps,
                            score=self.workload.score if params.pflash_keep_ratio else None,
                            niah_keys=tuple(self.workload.niah))
        gpu = self.hardware.gpu
        vram_cap = None
        if gpu is not None:
            vram_cap = min(gpu.total_mb, c.hardware.vram_cap_mb or gpu.total_mb)
        vram_peak = max(metrics.peak_mem_mb, summary.gpu_mem_max_mb or 0.0) if gpu else None
        limits = constraints(
            metrics, vram_cap_mb=vram_cap, vram_peak_mb=vram_peak,
            ram_cap_mb=c.hardware.ram_cap_mb or self.hardware.usable_ram_mb,
            rss_peak_mb=summary.rss_max_mb,
            uses_draft=params.draft is not None, greedy_identical=c.constraints.greedy_identical,
            uses_pflash=params.pflash_keep_ratio is not None,
            niah_min_accuracy=c.constraints.niah_min_accuracy)
        values = tuple(metrics.objective(m) for m in c.objectives.metrics)
        feasible = all(v <= 0 for v in limits.values())
        return Outcome(number=number, params=params, status="complete" if feasible else "infeasible",
                       reason="" if feasible else _violations(limits), values=values,
                       constraints=limits, metrics=metrics, telemetry=summary,
                       device=reply.device), sampler.samples

    def _record(self, number: int, phase: str, attempt: int, params: TrialParams,
                o: Outcome) -> MeasurementRecord:
        m = o.metrics
        return MeasurementRecord(
            study=self.config.study.name, trial_number=number, phase=phase, attempt=attempt,
            status=o.status, reason=o.reason, params=params.as_dict(),
            decode_tok_s=m.decode_tok_s.median if m else None, ttft_s=m.ttft_s.median if m else None,
            peak_mem_mb=m.peak_mem_mb if m else None,
            throttled=bool(o.telemetry and o.telemetry.throttled),
            metrics=(m.as_dict() | {"constraints": dict(o.constraints or {}), "device": o.device})
            if m else {},
            telemetry=o.telemetry.as_dict() if o.telemetry else {}, hardware_id=self.hardware_id)

    def _best(self) -> list[int]:
        try:
            return [t.number for t in self.study.best_trials]
        except ValueError:
            return []

    def _publish(self) -> tuple[Outcome | None, Path | None]:
        from tuner.publish import publish_winner

        return publish_winner(self)


class _Heartbeat:
    """Records the trial's heartbeat while it runs, so another run can tell it is alive."""

    def __init__(self, storage: Any, study_name: str, number: int, interval_s: int) -> None:
        trial_id = storage.get_trial_id_from_study_id_trial_number(
            storage.get_study_id_from_name(study_name), number)
        self._beat = lambda: storage.record_heartbeat(trial_id)
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def __enter__(self) -> "_Heartbeat":
        self._beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _requeue_stale(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """A trial of a killed run: measure the same point again (if it got as far as having one)."""
    if trial.params:
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})


def _violations(limits: Mapping[str, float]) -> str:
    return "violates " + ", ".join(f"{k} (+{v:g})" for k, v in limits.items() if v > 0)


def parse_hang(text: str | None) -> dict[int, float]:
    """The test hook's format, ``NUMBER:SECONDS[,NUMBER:SECONDS...]``."""
    out: dict[int, float] = {}
    for part in (text or "").split(","):
        if part.strip():
            number, _, seconds = part.partition(":")
            try:
                out[int(number)] = float(seconds or 3600)
            except ValueError:
                raise ConfigError(f"LUCE_TUNE_TEST_HANG: expected NUMBER:SECONDS, found {part!r}") from None
    return out


def hang_from_env() -> dict[int, float]:
    return parse_hang(os.environ.get("LUCE_TUNE_TEST_HANG"))
