"""A share of the cold experts computed by CPU threads while the GPU computes the rest.

With ``cold_device="gpu"`` every cold expert crosses the bus each time it is routed, and the bus
(about 55 GB/s on the H200's host) bounds a half-cold decode step. The host's own cores read the
same pinned copies from memory without crossing it, so a share of the cold pairs can be computed
there at the same time: ``HostShare`` runs a pool of native threads (``host_experts.c``, built with
the machine's C compiler on first use and cached) that wait on a mailbox in pinned host memory.

One decode-sized call of a layer, inside a captured CUDA graph like the rest of the step:
  1. ``publish`` (one launch): the pairs whose expert is in this layer's CPU set, their weights and
     the tokens' rows (float32) go into the mailbox, then a new sequence number, released at system
     scope after a system fence;
  2. the GPU computes the other cold pairs over the bus and the hot ones, while the threads compute
     theirs from host memory and write each token's weighted sum into the reply, then its sequence
     number;
  3. ``collect`` (one launch) waits for that number with acquire loads at system scope (bounded: after
     ``TIMEOUT_SPINS`` loads it marks the reply's status and goes on, so a missing pool cannot hang the
     device; a status already set ends it within a few thousand loads, so a step pays that bound once) and
     adds the sum into the layer's float32 output.
Off CUDA the same mailbox is written and read by torch on the host (the CPU tests' path).

The threads multiply float32 rows with weights dequantized in registers (Q4_0 and Q8_0, ggml's block
order or the split layout), summing each token's pairs in order: the result matches the device's
kernels to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from gguf import GGMLQuantizationType as Q

from engine.errors import ConfigError, EngineError
from engine.model.host_memory import mapped_view

SOURCE = Path(__file__).with_name("host_experts.c")
CACHE_ENV = "LUCE_TUNE_CACHE"  # where the built library is kept (default ~/.cache/luce-tune)
CFLAGS_ENV = "LUCE_TUNE_HOST_EXPERTS_CFLAGS"  # extra compiler flags (e.g. -DLT_PF=0), part of the cache key
QTYPES = (Q.Q4_0, Q.Q8_0)
HEADER = 32  # int32 words before the mailbox's ids (host_experts.c)
WARM_SEQ, WARM_LAYER, WARM_N, WARM_IDS, WARM_MAX = 20, 21, 22, 24, 8  # a warm-up's words (host_experts.c)
WARM_CHUNK = 16384  # bytes of an expert's matrix a thread fetches at a time in a warm-up (LT_WARM_CHUNK)
REPLY_HEADER = 16
MAX_PAIRS = 1024  # the native pool's limit
STAT_THREADS = 64  # threads whose phases a -DLT_STATS=1 build times (LT_STAT_THREADS)
TIMEOUT_SPINS = 1 << 24  # acquire loads over the bus before a device wait gives up (about 3 s on the H100 hosts)
WAIT_TIMEOUT_S = 30.0  # the host path's wait for a reply
THREAD_STATES = ("idle", "warm-up", "gate/up", "waiting for gate/up", "down")  # lt_pool_state's states (DIAG_*)
DIAG_THREADS = 64  # threads whose state lt_pool_state reports (LT_DIAG_THREADS)
STATUS_TEXT = {1: "a layer with no matrices registered", 2: "more tokens or pairs than the mailbox holds",
               -1: "the CPU threads did not answer within the device's wait"}
# the bus copier's mailbox (host_experts.c): number, layer, count, status, expert ids, then the ring of numbers
BUS_SEQ, BUS_LAYER, BUS_N, BUS_STATUS, BUS_IDS, BUS_MAX, BUS_RING, BUS_SLOTS = 0, 1, 2, 3, 8, 8, 16, 64
BUS_STATUS_TEXT = {1: "a layer whose experts were not registered", 2: "more experts than the stage holds, or an "
                   "expert id out of range", -1: "the copies did not land within the device's wait",
                   -2: "the driver refused a copy", -3: "the copier's thread could not take the device's context"}


def _state_name(code: int) -> str:
    return THREAD_STATES[code] if 0 <= code < len(THREAD_STATES) else str(code)


def describe_threads(states: Sequence[dict[str, Any]]) -> str:
    """The threads' states in a few words: how many stand where (with the job's number and the longest time there),
    and the longest stretch any of them spent in one state other than idle."""
    if not states:
        return "no thread state"
    groups: dict[tuple[str, int], list[float]] = {}
    for st in states:
        groups.setdefault((st["state"], st["seq"]), []).append(st["ms"])
    parts = [f"{len(ms)} {state} at number {seq} (up to {max(ms):,.1f} ms)"
             for (state, seq), ms in sorted(groups.items(), key=lambda kv: -len(kv[1]))]
    worst = max(range(len(states)), key=lambda i: states[i]["longest_ms"])
    st = states[worst]
    return (f"threads: {', '.join(parts)}; longest stretch: thread {worst} in {st['longest_state']} "
            f"for {st['longest_ms']:,.1f} ms")


def copier_state(lib: ctypes.CDLL, bus: int | None) -> dict[str, Any]:
    """``lt_bus_state`` of the copier ``bus`` as ``HostBus.state`` gives it ({} for none)."""
    out = (ctypes.c_int64 * 5)()
    if not bus or not hasattr(lib, "lt_bus_state") or lib.lt_bus_state(bus, out) != 0:
        return {}
    return {"seen": int(out[0]), "job_ms": None if out[1] < 0 else out[1] / 1e6, "idle_ms": out[2] / 1e6,
            "copy_ms": None if out[3] < 0 else out[3] / 1e6, "longest_copy_ms": out[4] / 1e6}


def describe_copier(state: dict[str, Any]) -> str:
    """The copier's state in a few words."""
    if not state:
        return "no copier state"
    where = (f"in a job for {state['job_ms']:,.1f} ms" if state["job_ms"] is not None
             else f"looking at the mailbox, its last job ended {state['idle_ms']:,.1f} ms ago")
    if state["copy_ms"] is not None:
        where += f", inside the driver's copy call for {state['copy_ms']:,.1f} ms"
    return (f"the copier last took number {state['seen']}, is {where}; its longest copy call took "
            f"{state['longest_copy_ms']:,.1f} ms")


def stall_report(share: Any, buses: Sequence[Any], seconds: float) -> str | None:
    """What has stood still for at least ``seconds``: a thread of ``share`` (a ``HostShare`` or None) in a job's
    or warm-up's state, or a copier of ``buses`` (``HostBus``) in one job or one call of the driver's copy; None
    when nothing has. A watchdog's question while a generation runs (``engine.engine.stall_trace_setting``)."""
    limit = seconds * 1e3
    found = []
    if share is not None:
        states = share.thread_states()
        if any(st["state"] != "idle" and st["ms"] >= limit for st in states):
            found.append(describe_threads(states))
    for bus in buses:
        st = bus.state()
        busy = [ms for ms in (st.get("job_ms"), st.get("copy_ms")) if ms is not None]
        if busy and max(busy) >= limit:
            found.append(describe_copier(st))
    return "; ".join(found) or None


class HostShareError(EngineError):
    """The CPU share of the cold experts failed (no reply, or a job it could not run)."""


_LIBS: dict[tuple[str, ...], ctypes.CDLL] = {}


def _cpu_key() -> str:
    """What the built code depends on besides its source: the machine, the compiler's target, the CPU's flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {platform.system()} {flags}"


def library(cflags: Sequence[str] | None = None) -> ctypes.CDLL:
    """The native pool, built on first use into the cache (a compiler is needed once per machine);
    ``cflags`` (default: ``LUCE_TUNE_HOST_EXPERTS_CFLAGS``) are added to the compiler's."""
    extra = list(os.environ.get(CFLAGS_ENV, "").split() if cflags is None else cflags)
    if tuple(extra) in _LIBS:
        return _LIBS[tuple(extra)]
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + _cpu_key().encode() + " ".join(extra).encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "luce-tune")
    path = cache / f"host_experts-{key}.so"
    if not path.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise ConfigError("the CPU share of the cold experts needs a C compiler (cc or gcc, or CC=...) "
                              "to build engine/kernels/host_experts.c once; none was found")
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        cmd = [cc, "-O3", "-march=native", "-shared", "-fPIC", "-pthread", *extra, "-o", tmp, str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise ConfigError(f"building engine/kernels/host_experts.c failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
        os.replace(tmp, path)  # whole or absent: a concurrent build of the same key writes the same bytes
    lib = ctypes.CDLL(str(path))
    lib.lt_start.restype = ctypes.c_void_p
    lib.lt_start.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 6
    lib.lt_matrix.restype = ctypes.c_int
    lib.lt_matrix.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                              ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.lt_jobs.restype = ctypes.c_int64
    lib.lt_jobs.argtypes = [ctypes.c_void_p]
    if hasattr(lib, "lt_pool_state"):  # where the threads stand (absent from a benchmark's older source)
        lib.lt_pool_state.restype = ctypes.c_int
        lib.lt_pool_state.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        lib.lt_bus_state.restype = ctypes.c_int
        lib.lt_bus_state.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]
    lib.lt_warm_chunks.restype = ctypes.c_int64
    lib.lt_warm_chunks.argtypes = [ctypes.c_void_p]
    lib.lt_warm_per_expert.restype = ctypes.c_int
    lib.lt_warm_per_expert.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.lt_spec_chunks.restype = ctypes.c_int64
    lib.lt_spec_chunks.argtypes = [ctypes.c_void_p]
    lib.lt_simd.restype = ctypes.c_int
    lib.lt_vnni.restype = ctypes.c_int
    lib.lt_dot8.restype = ctypes.c_int
    lib.lt_dot8.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.lt_stats.restype = ctypes.c_int
    lib.lt_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_double)]
    lib.lt_stop.argtypes = [ctypes.c_void_p]
    lib.lt_bus_start.restype = ctypes.c_void_p
    lib.lt_bus_start.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_uint64]
    lib.lt_bus_src.restype = ctypes.c_int
    lib.lt_bus_src.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_int64]
    lib.lt_bus_dst.restype = ctypes.c_int
    lib.lt_bus_dst.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int]
    lib.lt_bus_go.restype = ctypes.c_int
    lib.lt_bus_go.argtypes = [ctypes.c_void_p]
    lib.lt_bus_jobs.restype = ctypes.c_int64
    lib.lt_bus_jobs.argtypes = [ctypes.c_void_p]
    lib.lt_bus_stop.argtypes = [ctypes.c_void_p]
    _LIBS[tuple(extra)] = lib
    return lib


class HostShare:
    """The native thread pool, its mailbox and reply in pinned host memory, and the device's two launches.

    ``layers``: per layer (gate, up, down) as (blocks uint8 [E, rows, row_bytes] in host memory, qtype,
    rows, cols, layout ``"ggml"`` or ``"split"``), or None for a layer the pool never computes. The
    block tensors must outlive the pool (the threads read them in place). ``int8``: the threads round
    the token rows and the experts' inner activations to 8 bits per 32-block (ggml's Q8_0 activations,
    as llama.cpp's CPU experts do) and multiply in integers (``dot8``), several times fewer
    instructions a weight than float32; float32 otherwise."""

    def __init__(self, layers: Sequence[Sequence[tuple[torch.Tensor, Q, int, int, str]] | None], *,
                 hidden: int, ffn: int, threads: int, device: torch.device | str, max_tokens: int = 16,
                 max_pairs: int = 128, int8: bool = False, cflags: Sequence[str] | None = None):
        self.device = torch.device(device)
        if threads < 1:
            raise ConfigError(f"the CPU share needs at least one thread, got {threads}")
        if int8 and (hidden % 32 or ffn % 32):
            raise ConfigError(f"8-bit activations need hidden and ffn sizes that are multiples of 32, got {hidden} "
                              f"and {ffn}")
        self.int8 = int8
        if not 1 <= max_pairs <= MAX_PAIRS or max_tokens < 1:
            raise ConfigError(f"max_pairs must be 1..{MAX_PAIRS} and max_tokens >= 1, got {max_pairs}, {max_tokens}")
        self.hidden, self.ffn, self.threads = hidden, ffn, threads
        self.max_tokens, self.max_pairs = max_tokens, max_pairs
        pin = self.device.type == "cuda"
        self.mailbox = torch.zeros(HEADER + 2 * max_pairs + max_tokens * hidden, dtype=torch.int32, pin_memory=pin)
        self.reply = torch.zeros(REPLY_HEADER + max_tokens * hidden, dtype=torch.int32, pin_memory=pin)
        self._blocks = []  # kept alive: the threads read them
        lib = library(cflags)
        self._lib = lib
        self._pool = lib.lt_start(threads, self.mailbox.data_ptr(), self.reply.data_ptr(), max_pairs, max_tokens,
                                  hidden, ffn, len(layers), int(int8))
        if not self._pool:
            raise ConfigError(f"the CPU share's thread pool did not start ({threads} threads, hidden {hidden}, "
                              f"ffn {ffn}, {max_pairs} pairs)")
        try:
            for i, mats in enumerate(layers):
                if mats is None:
                    continue
                for which, (blocks, qtype, rows, cols, layout) in enumerate(mats):
                    if qtype not in QTYPES:
                        raise ConfigError(f"layer {i}: the CPU share computes Q4_0 and Q8_0 experts, not "
                                          f"{Q(qtype).name}")
                    if not blocks.is_contiguous() or blocks.device.type != "cpu" or blocks.dtype != torch.uint8:
                        raise ConfigError(f"layer {i}: the CPU share reads contiguous uint8 host blocks")
                    rc = lib.lt_matrix(self._pool, i, which, blocks.data_ptr(), blocks.shape[0], rows, cols,
                                       blocks.shape[-1], int(qtype), int(layout == "split"))
                    if rc != 0:
                        raise ConfigError(f"layer {i}: matrix {('gate', 'up', 'down')[which]} of {rows} x {cols} "
                                          f"({Q(qtype).name}, {blocks.shape[-1]} bytes a row) does not fit the "
                                          f"CPU share (hidden {hidden}, ffn {ffn})")
                    self._blocks.append(blocks)
        except BaseException:
            self.close()
            raise
        self._reply_np = self.reply.numpy()  # the status word read without torch's indexing
        self.seq = torch.zeros(1, dtype=torch.int32, device=self.device)  # the last sequence number published
        self.pending = torch.zeros(1, dtype=torch.int32, device=self.device)  # the split launch's job flag
        self.warm_seq = torch.zeros(1, dtype=torch.int32, device=self.device)  # the last warm-up number published
        self._host_warm = 0
        self._host_seq = 0
        if pin:
            self.mailbox_dev = mapped_view(self.mailbox, self.device)
            self.reply_dev = mapped_view(self.reply, self.device)

    @property
    def simd(self) -> int:
        """The vector width of the threads' dot products in bits: 512 (AVX-512), 256 (AVX2 + FMA), 0 (the
        portable loop)."""
        return int(self._lib.lt_simd())

    @property
    def vnni(self) -> bool:
        """Whether 8-bit activations' dot products use AVX-512 VNNI (rows of a multiple of 512 columns)."""
        return bool(self._lib.lt_vnni())

    @property
    def jobs(self) -> int:
        """Layers' calls the threads have answered."""
        return int(self._lib.lt_jobs(self._pool)) if self._pool else 0

    def stats(self) -> dict[str, float | list[list[float]]] | None:
        """Where the threads' time went, for a pool built with ``-DLT_STATS=1`` (None otherwise): ``jobs``,
        ``job_us`` (mean time from the first thread's look at a job to its reply) and per thread the mean
        microseconds of phase 1 (gate and up), the wait for the other threads after it, and phase 2 (down)."""
        n = min(self.threads, STAT_THREADS)
        out = (ctypes.c_double * (2 + 3 * n))()
        if not self._pool or self._lib.lt_stats(self._pool, out) != 0:
            return None
        per = [[out[2 + 3 * i + j] / 1e3 for j in range(3)] for i in range(n)]
        return {"jobs": out[0], "job_us": out[1] / 1e3, "threads": per}

    def dot8(self, row: torch.Tensor, qtype: Q, layout: str, x: torch.Tensor) -> tuple[float, float]:
        """One row of blocks (uint8) times ``x`` [cols] float32 as the 8-bit mode computes it: by the plain
        loop, and by the VNNI loop (NaN where it is not built or the row is not a multiple of 512)."""
        out = (ctypes.c_float * 2)()
        x = x.contiguous().float()
        row = row.contiguous()
        if self._lib.lt_dot8(row.data_ptr(), x.numel(), int(qtype), int(layout == "split"), x.data_ptr(), out) != 0:
            raise ValueError(f"dot8: {x.numel()} columns of {Q(qtype).name} are not a row it computes")
        return out[0], out[1]

    @property
    def warm_chunks(self) -> int:
        """Chunks of experts' blocks the threads have fetched into their caches for warm-ups (``warm``)."""
        return int(self._lib.lt_warm_chunks(self._pool)) if self._pool else 0

    def warm_per_expert(self, layer: int) -> int:
        """The chunks a warm-up of ``layer`` counts in ``warm_chunks`` for each expert it names (as the pool's build
        cuts them); -1 for a layer the pool does not compute."""
        return int(self._lib.lt_warm_per_expert(self._pool, layer)) if self._pool else -1

    @property
    def spec_chunks(self) -> int | None:
        """Chunks the threads fetched ahead of their warm-up, from the layer's last warm-up (a pool built with
        ``-DLT_SPEC=1``), or None where the pool is built without it."""
        n = int(self._lib.lt_spec_chunks(self._pool)) if self._pool else 0
        return None if n < 0 else n

    def warm(self, layer: int, experts: Sequence[int]) -> None:
        """Name up to ``WARM_MAX`` experts of ``layer`` that a coming job is expected to hand the threads
        (-1: none): idle threads fetch their blocks into their caches, and leave off when a job comes. From
        the host; on CUDA ``hybrid_split.select_prefetch`` writes these words from the device."""
        if not 1 <= len(experts) <= WARM_MAX:
            raise ValueError(f"a warm-up names 1 to {WARM_MAX} experts, got {len(experts)}")
        mb = self.mailbox
        mb[WARM_LAYER], mb[WARM_N] = layer, len(experts)
        mb[WARM_IDS:WARM_IDS + len(experts)] = torch.tensor(list(experts), dtype=torch.int32)
        self._host_warm = (self._host_warm + 1) & 0x7FFFFFFF
        mb[WARM_SEQ] = self._host_warm  # after the names, as publish's sequence number

    def fits(self, tokens: int, k: int) -> bool:
        return tokens <= self.max_tokens and tokens * k <= self.max_pairs

    def publish(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, mine: torch.Tensor) -> None:
        """Hand the pairs of ``ids`` [T, k] whose expert has ``mine[id]`` set (int8 [E]) to the threads:
        x [T, H], w [T, k] float32. Returns at once; ``collect`` adds their sum."""
        T, k = ids.shape
        if not self.fits(T, k):
            raise ValueError(f"{T} tokens of {k} pairs do not fit the mailbox ({self.max_tokens} tokens, "
                             f"{self.max_pairs} pairs)")
        if self.device.type == "cuda":
            from engine.kernels.host_share_triton import publish

            publish(self, layer, x, ids, w, mine)
            return
        P = T * k
        mb = self.mailbox
        mb[16], mb[17], mb[18] = layer, T, k
        flat = ids.reshape(-1)
        mb[HEADER:HEADER + P] = torch.where(mine[flat] != 0, flat, -1).to(torch.int32)
        f32 = mb.view(torch.float32)
        f32[HEADER + self.max_pairs:HEADER + self.max_pairs + P] = w.reshape(-1).float()
        start = HEADER + 2 * self.max_pairs
        f32[start:start + T * self.hidden] = x.reshape(-1).float()
        self._host_seq = (self._host_seq + 1) & 0x7FFFFFFF
        mb[0] = self._host_seq  # after the payload (x86 and arm64 keep a thread's stores in order for this)
        self._pending = T

    def collect(self, out: torch.Tensor) -> None:
        """Add the threads' sum for the last ``publish`` into ``out`` [T, H] float32."""
        if self.device.type == "cuda":
            from engine.kernels.host_share_triton import collect

            collect(self, out)
            return
        deadline = time.perf_counter() + WAIT_TIMEOUT_S
        while int(self.reply[0]) != self._host_seq:
            if time.perf_counter() > deadline:
                raise HostShareError(f"the CPU share did not answer within {WAIT_TIMEOUT_S:.0f} s")
            time.sleep(0)
        self.check()
        T = out.shape[0]
        y = self.reply.view(torch.float32)[REPLY_HEADER:REPLY_HEADER + T * self.hidden]
        out += y.view(T, self.hidden).to(out.device)

    def check(self) -> None:
        """Raise ``HostShareError`` if a job failed or the device's wait gave up (reads host memory: no sync);
        the message says where the threads stood (``describe_threads``)."""
        status = int(self._reply_np[1])
        if status:
            raise HostShareError(f"the CPU share of the cold experts failed: "
                                 f"{STATUS_TEXT.get(status, f'status {status}')} (the threads answered {self.jobs} "
                                 f"jobs; the mailbox names number {int(self.mailbox[0])}, the last reply "
                                 f"{int(self._reply_np[0])}; {describe_threads(self.thread_states())})")

    def thread_states(self) -> list[dict[str, Any]]:
        """Where each thread stands (the first 64): ``state`` (``THREAD_STATES``), ``seq`` (the job or warm-up it is
        in or last left), ``ms`` in that state so far, and ``longest_ms`` spent in one state other than idle with
        that ``longest_state``."""
        n = min(self.threads, DIAG_THREADS)
        out = (ctypes.c_int64 * (5 * n))()
        n = self._lib.lt_pool_state(self._pool, out, n) if self._pool and hasattr(self._lib, "lt_pool_state") else 0
        return [{"state": _state_name(out[5 * i]), "seq": int(out[5 * i + 1]), "ms": out[5 * i + 2] / 1e6,
                 "longest_ms": out[5 * i + 3] / 1e6, "longest_state": _state_name(out[5 * i + 4])} for i in range(n)]

    def close(self) -> None:
        """Stop the threads (no call may be in flight: the device's work is synchronised first)."""
        if getattr(self, "_pool", None):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._lib.lt_stop(self._pool)
            self._pool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class HostBus:
    """The bus's copier: a native thread that has the device's copy engine fetch cold experts ahead.

    ``layers``: per layer the (gate, up, down) host blocks [E, ...] (pinned on CUDA), or None for a layer
    never fetched; ``stage``: the three device tensors whose rows 0, 1, ... take the fetched experts' slabs
    (each row at least a slab). The device names a layer's experts in the mailbox
    (``hybrid_split.select_prefetch(bus=)``) and waits for them before reading the rows
    (``host_share_triton.bus_wait``); the thread queues a host -> device copy a matrix on a stream of its own and
    then one of the job's number into ``flag``. The copy engine reads pinned memory at the bus's rate and takes no
    SM from the kernels beside it, where a copy kernel reading mapped memory holds SMs and reached about half that
    rate beside a layer (docs/benchmarks.md, twenty-first round). On a CPU device (the tests) the same thread
    copies with ``memcpy`` and ``fetch``/``wait`` stand in for the device's launches. The blocks and the stage
    must outlive the copier."""

    def __init__(self, layers: Sequence[Sequence[torch.Tensor] | None], stage: Sequence[torch.Tensor], *,
                 device: torch.device | str, cflags: Sequence[str] | None = None):
        self.device = torch.device(device)
        self._bus = None
        if len(stage) != 3:
            raise ConfigError(f"the bus's copier fills three stage tensors (gate, up, down), got {len(stage)}")
        cuda = self.device.type == "cuda"
        for t in stage:
            if t.device.type != self.device.type or not t.is_contiguous():
                raise ConfigError(f"the copier's stage must be contiguous {self.device.type} tensors, got "
                                  f"{t.device} {tuple(t.shape)}")
        self.rows = min(min(t.shape[0] for t in stage), BUS_MAX)
        self.mailbox = torch.zeros(BUS_RING + BUS_SLOTS, dtype=torch.int32, pin_memory=cuda)
        self.flag = torch.zeros(1, dtype=torch.int32, device=self.device)  # the last number whose copies landed
        self.seq = torch.zeros(1, dtype=torch.int32, device=self.device)  # the last number published
        self._host_seq = 0
        self._mb_np = self.mailbox.numpy()
        lib = library(cflags)
        self._lib = lib
        self._keep = [list(stage)]
        if cuda:
            torch.cuda.init()
            with torch.cuda.device(self.device):
                torch.cuda.current_stream(self.device).synchronize()  # the context exists and is current here
                self._stream = torch.cuda.Stream(self.device)
            driver = ctypes.CDLL("libcuda.so.1")
            ctx = ctypes.c_void_p()
            with torch.cuda.device(self.device):
                if driver.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
                    raise ConfigError("the bus's copier found no current CUDA context")
            copy = ctypes.cast(driver.cuMemcpyHtoDAsync_v2, ctypes.c_void_p).value
            set_ctx = ctypes.cast(driver.cuCtxSetCurrent, ctypes.c_void_p).value
            args = (copy, set_ctx, ctx.value, self._stream.cuda_stream)
            self._keep.append(driver)
            self.mailbox_dev = mapped_view(self.mailbox, self.device)
        else:
            args = (ctypes.cast(lib.lt_copy_host, ctypes.c_void_p).value, None, None, None)
        self._bus = lib.lt_bus_start(self.mailbox.data_ptr(), len(layers), *args, self.flag.data_ptr())
        if not self._bus:
            raise ConfigError(f"the bus's copier did not start ({len(layers)} layers)")
        try:
            for which, t in enumerate(stage):
                row = t[0].numel() * t.element_size()
                if lib.lt_bus_dst(self._bus, which, t.data_ptr(), row, self.rows) != 0:
                    raise ConfigError(f"stage {which} ({tuple(t.shape)}) does not take fetched experts")
            for i, mats in enumerate(layers):
                if mats is None:
                    continue
                if len(mats) != 3:
                    raise ConfigError(f"layer {i}: the copier fetches (gate, up, down), got {len(mats)} matrices")
                for which, (blocks, t) in enumerate(zip(mats, stage)):
                    if (not blocks.is_contiguous() or blocks.device.type != "cpu" or (cuda and not blocks.is_pinned())
                            or blocks.dtype != t.dtype or blocks.shape[1:] != t.shape[1:]):
                        raise ConfigError(f"layer {i}: matrix {('gate', 'up', 'down')[which]} must be contiguous "
                                          f"{'pinned ' if cuda else ''}host blocks of the stage's dtype and expert "
                                          f"shape {t.dtype} {tuple(t.shape[1:])}, got {blocks.dtype} "
                                          f"{tuple(blocks.shape)}")
                    slab = blocks[0].numel() * blocks.element_size()
                    if lib.lt_bus_src(self._bus, i, which, blocks.data_ptr(), blocks.shape[0], slab) != 0:
                        raise ConfigError(f"layer {i}: matrix {which} does not fit the copier")
                    self._keep.append(blocks)
            if lib.lt_bus_go(self._bus) != 0:
                raise ConfigError("the bus's copier could not start its thread (a layer's matrices missing, or "
                                  "larger than the stage's rows)")
        except BaseException:
            self.close()
            raise

    @property
    def jobs(self) -> int:
        """Fetches the thread has queued."""
        return int(self._lib.lt_bus_jobs(self._bus)) if self._bus else 0

    def fetch(self, layer: int, experts: Sequence[int]) -> None:
        """Name up to ``rows`` experts of ``layer`` (-1: none) for stage rows 0, 1, ... from the host; on CUDA
        the device's select launch writes these words (``hybrid_split.select_prefetch(bus=)``)."""
        if not 0 <= len(experts) <= self.rows:
            raise ValueError(f"a fetch names 0 to {self.rows} experts, got {len(experts)}")
        mb = self._mb_np
        mb[BUS_LAYER], mb[BUS_N] = layer, len(experts)
        mb[BUS_IDS:BUS_IDS + len(experts)] = list(experts)
        self._host_seq = (self._host_seq + 1) & 0x7FFFFFFF
        mb[BUS_SEQ] = self._host_seq  # after the names (the host's stores stay in order for this)

    def wait(self, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Until the copies of the last ``fetch`` have landed (on CUDA: the stream's work done)."""
        deadline = time.perf_counter() + timeout_s
        while True:
            if self.device.type == "cuda":
                self._stream.synchronize()
            if int(self.flag[0]) == self._host_seq:
                break
            self.check()
            if time.perf_counter() > deadline:
                raise HostShareError(f"the bus's copier did not answer within {timeout_s:.0f} s")
            time.sleep(0)
        self.check()

    def check(self) -> None:
        """Raise ``HostShareError`` if a fetch failed or the device's wait gave up (reads host memory; only a
        failure's message reads the device's flag)."""
        status = int(self._mb_np[BUS_STATUS])
        if status:
            mb = self._mb_np  # where the copier stood: what a timeout's cause is read from
            jobs, state = self.jobs, describe_copier(self.state())
            raise HostShareError(f"the bus's copier failed: {BUS_STATUS_TEXT.get(status, f'status {status}')} "
                                 f"(the copier ran {jobs} jobs; the mailbox names number {int(mb[BUS_SEQ])}, "
                                 f"layer {int(mb[BUS_LAYER])}, {int(mb[BUS_N])} experts; {state}; the last number "
                                 f"landed {int(self.flag[0])})")

    def state(self) -> dict[str, float | int | None]:
        """Where the copier's thread stands: ``seen`` (the last number it took), ``job_ms`` in its current job
        (None: it is looking at the mailbox), ``idle_ms`` since its last job ended, ``copy_ms`` in its current call
        of the driver's copy (None: none), ``longest_copy_ms``."""
        return copier_state(self._lib, self._bus)

    def close(self) -> None:
        """Stop the thread (the device's work is synchronised first, so no copy is left in flight)."""
        if getattr(self, "_bus", None):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._lib.lt_bus_stop(self._bus)
            if self.device.type == "cuda":
                self._stream.synchronize()
            self._bus = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
