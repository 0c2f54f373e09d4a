"""The long-lived engine worker: a spawned process that hosts one Engine and runs trials.

The tuner never runs the model itself: a trial that hangs, crashes or runs the GPU out of
memory takes down only the worker, which is killed and started again on the next request.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from tuner.protocol import (
    Failure,
    Job,
    Load,
    Loaded,
    Loading,
    LoadSpec,
    Measure,
    Measured,
    Output,
    Shutdown,
)

ENGINE_FACTORY = "engine.engine:Engine.from_gguf"
WARMUP_TOKENS = 4


class WorkerError(Exception):
    """A request the worker did not answer: ``reason`` says why, for the trial's record."""

    def __init__(self, reason: str, *, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind  # "timeout", "crash", "oom", "user" or "error"


class EngineWorker:
    """The tuner's handle on the worker process (multiprocessing spawn, one pipe)."""

    def __init__(self, factory: str = ENGINE_FACTORY) -> None:
        self.factory = factory
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self.answered = 0  # measurements answered since the process started

    @property
    def cold(self) -> bool:
        """True until the running process answers a measurement: the next one also pays the
        process start, the engine load and the GPU kernels' first compilation."""
        return not self.alive or self.answered == 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child, self.factory, os.getpid()),
                                 name="luce-tune-worker", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self.answered = 0

    def ensure_started(self) -> None:
        if not self.alive:
            self.kill()
            self.start()

    def request(self, message: Load | Measure, *, timeout_s: float, load_timeout_s: float) -> Any:
        """Send a request and wait for its answer.

        ``timeout_s`` bounds the work, ``load_timeout_s`` an engine load announced by the
        worker. On a timeout or a crash the worker is killed and ``WorkerError`` raised; a
        ``Failure`` the worker reports is raised as ``WorkerError`` too (the worker lives on,
        except after running out of memory).
        """
        self.ensure_started()
        assert self._conn is not None
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):
            raise self._crashed() from None
        limit = timeout_s
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._conn.poll(remaining):
                if self.alive:
                    self.kill()
                    raise WorkerError(f"no answer within {limit:.0f} s: the worker was killed",
                                      kind="timeout")
                raise self._crashed()
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                raise self._crashed() from None
            if isinstance(reply, Loading):
                limit = load_timeout_s
                deadline = time.monotonic() + limit
                continue
            if isinstance(reply, Loaded) and isinstance(message, Measure):
                limit = timeout_s
                deadline = time.monotonic() + limit
                continue
            if isinstance(reply, Failure):
                if reply.kind == "oom":
                    self.kill()
                raise WorkerError(reply.message, kind=reply.kind)
            if isinstance(reply, Measured):
                self.answered += 1
            return reply

    def _crashed(self) -> WorkerError:
        code = None
        if self._proc is not None:
            self._proc.join(timeout=5)
            code = self._proc.exitcode
        self.kill()
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            why = f"the worker died of {name}"
        else:
            why = f"the worker exited with status {code}"
        return WorkerError(why + (" (out of memory?)" if code == -signal.SIGKILL else ""),
                           kind="crash")

    def kill(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=10)
            self._proc = None

    def stop(self) -> None:
        """Ask the worker to exit, killing it if it does not within a few seconds."""
        if self._conn is not None and self.alive:
            try:
                self._conn.send(Shutdown())
            except (BrokenPipeError, OSError):
                pass
            if self._proc is not None:
                self._proc.join(timeout=5)
        self.kill()

    def __enter__(self) -> "EngineWorker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(conn: Connection, factory: str, parent_pid: int) -> None:
    """The worker's main loop (runs in the spawned process)."""
    _exit_with_parent(parent_pid)
    host = _EngineHost(_resolve(factory), conn)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if isinstance(message, Shutdown):
            return
        try:
            if isinstance(message, Load):
                host.ensure(message.spec, message.expert_budget_mb)
                conn.send(Loaded(load_s=host.load_s, device=host.device))
            elif isinstance(message, Measure):
                conn.send(host.measure(message))
            else:
                conn.send(Failure("error", f"unknown request {type(message).__name__}"))
        except Exception as exc:  # reported to the tuner, which records it with the trial
            kind = _failure_kind(exc)
            conn.send(Failure(kind, _describe(exc)))
            if kind == "oom":
                return  # a fresh process is the only sure way back to a clean GPU


class _EngineHost:
    """The engine a worker holds, reloaded only when a LoadSpec field changes."""

    def __init__(self, load: Callable[..., Any], conn: Connection) -> None:
        self._load = load
        self._conn = conn
        self.engine: Any = None
        self.spec: LoadSpec | None = None
        self.budget_mb: int | None = None
        self.cpu_share = 0.0  # the loaded engine's cold experts' CPU share
        self.ahead = (0, 0)  # the loaded engine's cold experts fetched and warmed ahead a layer
        self.unit = "expert"  # what the loaded engine's hot set grows by
        self.load_s = 0.0

    @property
    def device(self) -> str:
        return str(getattr(self.engine, "device", "unknown"))

    def ensure(self, spec: LoadSpec, budget_mb: int | None, unit: str | None = None) -> bool:
        """Load ``spec`` unless it is what is loaded; set the expert budget (grown by ``unit``, None: as the
        engine has it) in place."""
        if self.engine is not None and spec == self.spec:
            if budget_mb is not None and (budget_mb != self.budget_mb or (unit is not None and unit != self.unit)):
                self.engine.set_expert_budget(budget_mb, unit=unit)
                self.budget_mb, self.unit = budget_mb, unit or self.unit
            return False
        self._conn.send(Loading())
        self.engine = self.spec = None  # free the old engine before loading the next
        options = {"draft": spec.draft, "drafter": spec.drafter, "dtype": spec.dtype,
                   "threads": spec.threads, "expert_budget_mb": budget_mb,
                   "placement_unit": unit if budget_mb is not None else None,
                   "pflash_threshold": spec.pflash_threshold if spec.drafter else None, **dict(spec.options)}
        t0 = time.perf_counter()
        self.engine = self._load(spec.target, device=spec.device,
                                 **{k: v for k, v in options.items() if v is not None})
        self.load_s = time.perf_counter() - t0
        self.spec, self.budget_mb, self.cpu_share, self.ahead = spec, budget_mb, 0.0, (0, 0)
        self.unit = unit if unit is not None and budget_mb is not None else "expert"
        return True

    def share(self, share: float | None) -> None:
        """Set the cold experts' CPU share (None: 0) where it differs from the engine's, and after a budget
        change (which places the experts anew)."""
        share = share or 0.0
        if share or self.cpu_share:
            self.engine.set_cold_cpu_share(share)
        self.cpu_share = share

    def fetch_ahead(self, prefetch: int | None, warm: int | None) -> None:
        """Set the cold experts fetched and warmed ahead a layer (None: 0) where they differ from the engine's."""
        ahead = (prefetch or 0, warm or 0)
        if ahead != self.ahead:
            self.engine.set_cold_prefetch(ahead[0], warm=ahead[1])
        self.ahead = ahead

    def measure(self, m: Measure) -> Measured:
        if self.ensure(m.spec, m.expert_budget_mb, m.placement_unit):
            self._conn.send(Loaded(load_s=self.load_s, device=self.device))
        self.share(m.cold_cpu_share)
        self.fetch_ahead(m.cold_prefetch, m.cold_warm)
        if m.hang_s > 0:
            time.sleep(m.hang_s)
        tok = self.engine.tokenizer
        prompts = [tok.encode(job.prompt) for job in m.jobs]
        for _ in range(m.warmup):
            for job, ids in zip(m.jobs, prompts):
                self._generate(m, job, ids, min(job.max_new_tokens, WARMUP_TOKENS))
        outputs = []
        for r in range(m.repeats):
            for job, ids in zip(m.jobs, prompts):
                gen = self._generate(m, job, ids, job.max_new_tokens)
                margins = tuple(self.engine.greedy_margins(ids, gen.ids)) if m.margins else ()
                outputs.append(Output(key=job.key, repeat=r, ids=tuple(gen.ids), text=gen.text,
                                      timings=gen.timings.as_dict(), margins=margins))
        return Measured(outputs=tuple(outputs), device=self.device)

    def _generate(self, m: Measure, job: Job, ids: list[int], n: int) -> Any:
        options: dict[str, Any] = {}
        if m.spec_len is not None:
            options["spec_len"] = m.spec_len
            if m.spec_lookup is not None:
                options["spec_lookup"] = m.spec_lookup
        if m.pflash_keep_ratio is not None and job.long:
            options["pflash_keep_ratio"] = m.pflash_keep_ratio
        # ignore_eos: every repeat decodes the same number of tokens, so rates compare.
        return self.engine.generate(ids, n, temperature=0.0, seed=m.seed, ignore_eos=True, **options)


def _resolve(factory: str) -> Callable[..., Any]:
    module, _, attrs = factory.partition(":")
    obj: Any = importlib.import_module(module)
    for name in attrs.split("."):
        obj = getattr(obj, name)
    return obj


def _failure_kind(exc: Exception) -> str:
    from engine.errors import EngineError

    if isinstance(exc, EngineError):
        return "user"
    # torch.cuda.OutOfMemoryError from the allocator, or a kernel's "CUDA error: out of memory"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" \
            or "out of memory" in str(exc).lower():
        return "oom"
    return "error"


def _describe(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return first if _failure_kind(exc) == "user" else f"{type(exc).__name__}: {first}"


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when the tuner dies (kill -9 included), even in the middle of a hung trial."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
