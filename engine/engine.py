"""Engine: the public face of the inference engine (load, logits, generate, knobs)."""

from __future__ import annotations

import faulthandler
import functools
import os
import resource
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from engine.errors import ConfigError, EngineError, GenerationStalled
from engine.gguf.reader import GGUFFile
from engine.model.qwen35moe import Qwen35MoE
from engine.placement import PLACEMENT_UNITS
from engine.sampling import SamplingParams, make_generator, sample
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.dflash.draft import DFlashDraft
    from engine.model.decode_graph import DecodeGraph
    from engine.model.prefill_graph import PrefillGraph
    from engine.model.state import ModelState
    from engine.hybrid import HybridExperts
    from engine.pflash.drafter import Drafter
    from engine.pflash.select import PFlashConfig
    from engine.placement import Placement


GRAPH_MIN_TOKENS = 1024  # smallest state a captured decode step is built for
MAX_DECODE_GRAPHS = 3  # captured decode steps kept per engine (each owns a state of its capacity)
# captured padded prefills kept per engine: one per padded length (they share one memory pool and one state,
# so each adds only its graph and its input and logits buffers)
MAX_PREFILL_GRAPHS = 11
# tokens per chunk of an eager prefill (Engine.prefill_chunk): the benchmarks' 8K prompt stays one forward;
# LUCE_TUNE_PREFILL_CHUNK sets another size, 0 prefills every prompt in one forward
PREFILL_CHUNK = 8192
BLOCKING_WAIT_ENV = "LUCE_TUNE_BLOCKING_WAIT"  # 1: the decode loop's wait for a token sleeps (blocking_wait_setting)
STALL_TRACE_ENV = "LUCE_TUNE_STALL_TRACE"  # seconds: what stands still and the Python stacks (stall_trace_setting)


def prefill_chunk_setting() -> int | None:
    """``PREFILL_CHUNK``, or what ``LUCE_TUNE_PREFILL_CHUNK`` says (0: None, one forward)."""
    text = os.environ.get("LUCE_TUNE_PREFILL_CHUNK")
    if text is None:
        return PREFILL_CHUNK
    if not text.strip().isdigit():
        raise ConfigError(f"LUCE_TUNE_PREFILL_CHUNK must be a whole number of tokens (0: no chunks), got {text!r}")
    return int(text) or None


def blocking_wait_setting() -> bool:
    """Whether the decode loop's wait for a token sleeps (``LUCE_TUNE_BLOCKING_WAIT=1``) rather than spins (0, the
    default, CUDA's own schedule with one context: the process's thread holds a core while the step runs). A
    sleeping wait leaves that core to the CPU share's threads; the loop waits one step behind the device, so a
    wake-up's latency is hidden behind the next step."""
    text = os.environ.get(BLOCKING_WAIT_ENV, "").strip() or "0"
    if text not in ("0", "1"):
        raise ConfigError(f"{BLOCKING_WAIT_ENV} must be 0 or 1, got {text!r}")
    return text == "1"


def stall_trace_setting() -> float | None:
    """``LUCE_TUNE_STALL_TRACE``: None (unset, empty or 0), or the seconds after which a generation still running
    prints every Python thread's stack to stderr, once, and after which a CPU thread or copier standing still is
    reported (``_traced_stalls``)."""
    text = os.environ.get(STALL_TRACE_ENV, "").strip() or "0"
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ConfigError(f"{STALL_TRACE_ENV} must be a number of seconds (0: off), got {text!r}")
    return seconds or None


def _traced_stalls(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (an ``Engine`` method) with ``stall_trace_setting``'s stack dumps armed while it runs.

    A watchdog thread looks every tick (50 ms at most): once the generation has run for those seconds it prints
    every Python thread's stack, and where the engine has CPU threads or a copier, the first time one has stood
    still that long it prints what stands still and the stacks (what the process was doing meanwhile). The
    watchdog dumps while it holds the interpreter's lock, so no thread's frames change under the dump.

    A thread blocked in a call that keeps that lock (a driver call made without releasing it) would stop the
    watchdog too; for that case ``faulthandler``'s own timer, which needs no lock, is armed for the same seconds
    and re-armed by the watchdog every tick, so that it fires only when no Python thread has run for that long,
    when the frames it reads stand still. Its timer left running while Python threads run would read frames
    that change under it: one such dump, in the middle of a Triton compilation, ended a process with a
    segmentation fault."""
    @functools.wraps(fn)
    def traced(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        seconds = stall_trace_setting()
        if seconds is None:
            return fn(self, *args, **kwargs)
        done = threading.Event()
        tick = min(0.05, seconds / 4)
        started = time.monotonic()

        def watch() -> None:
            dumped = False
            try:
                while True:
                    faulthandler.dump_traceback_later(seconds, repeat=False, file=sys.stderr)
                    if done.wait(tick):
                        return
                    report = self.hybrid.stall_report(seconds) if self.hybrid is not None else None
                    if report:
                        print(f"luce-tune: stood still for {seconds:g} s or more: {report}", file=sys.stderr,
                              flush=True)
                        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                        return
                    if not dumped and time.monotonic() - started >= seconds:
                        print(f"luce-tune: the generation is still running after {seconds:g} s; the threads' "
                              "stacks:", file=sys.stderr, flush=True)
                        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                        dumped = True
            finally:
                faulthandler.cancel_dump_traceback_later()

        watcher = threading.Thread(target=watch, name="luce-tune-stall-watch", daemon=True)
        watcher.start()
        try:
            return fn(self, *args, **kwargs)
        finally:
            done.set()
            watcher.join()

    return traced


def graph_capacity(tokens: int) -> int:
    """The state capacity a request of ``tokens`` prompt + new tokens decodes in, so that requests
    of similar lengths share one captured graph: rounded up to a quarter of the next power of
    two, at least ``GRAPH_MIN_TOKENS`` (the captured step attends over the whole capacity, so
    past 4,096 tokens at most a third of it is spare)."""
    quarter = max(GRAPH_MIN_TOKENS, (1 << (tokens - 1).bit_length()) // 4)
    return -(-tokens // quarter) * quarter


@dataclass
class Timings:
    """What one generation measured. Optional groups are filled by the features in use."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0  # time to first token: prefill forward + first sample
    decode_s: float = 0.0
    decode_tok_s: float = 0.0  # (new_tokens - 1) / decode_s
    peak_mem_mb: float = 0.0  # peak CUDA memory allocated, or the process's peak RSS on the CPU
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


@dataclass
class Generation:
    ids: list[int]
    text: str
    timings: Timings
    stop_reason: str  # "length", "eos" or "stop"

    def as_dict(self) -> dict[str, Any]:
        return {"ids": self.ids, "text": self.text, "stop_reason": self.stop_reason,
                "timings": self.timings.as_dict()}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r} was asked for, but no CUDA device is available")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ConfigError(f"dtype {dtype!r} is not one of {sorted(names)}")
    return names[dtype]


class Engine:
    """A loaded qwen35moe model with its tokenizer, ready to generate."""

    def __init__(self, *, path: Path, model: Qwen35MoE, tokenizer: Tokenizer,
                 device: torch.device, dtype: torch.dtype, load_s: float,
                 stall_timeout_s: float, routing_stats_path: Path | None = None,
                 drafter: "Drafter | None" = None, pflash: "PFlashConfig | None" = None,
                 cold_format: str = "dense", cuda_graph: bool = True, hot_format: str = "dense",
                 cold_device: str = "cpu") -> None:
        self.path = path
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.load_s = load_s
        self.stall_timeout_s = stall_timeout_s
        self.routing_stats_path = routing_stats_path
        self.cold_format = cold_format  # how hybrid placement holds cold experts: "dense" or "quantized"
        self.hot_format = hot_format  # how it holds hot experts on the device: "dense" or "quantized"
        self.cold_device = cold_device  # what computes the cold experts: "cpu" threads or the "gpu" over the bus
        self.hybrid: "HybridExperts | None" = None
        self.drafter = drafter
        self.pflash = pflash
        self.draft: "DFlashDraft | None" = None
        self.defaults: dict[str, Any] = {}  # generate() options a profile chose (spec_len, keep ratio)
        self.cuda_graph = cuda_graph  # plain decoding replays a captured decode step where it can
        self._graphs: dict[int, "DecodeGraph"] = {}  # state capacity -> decode step, least recently used first
        # "decode" / "prefill" -> why capturing it failed (that path then runs eagerly from then on)
        self._capture_failures: dict[str, str] = {}
        # With cuda_graph: prompts up to prefill_graph.BUCKETS[-1] tokens prefill through a captured padded
        # prefill (``engine.model.prefill_graph``), 1.16-5.5x faster than eagerly on the H200's 35B file
        # from 100 to 2,048 tokens (docs/benchmarks.md); False prefills eagerly
        self.prefill_graph = True
        # A padded length is captured at its prompt after this many eager prefills of that length: a
        # capture costs 0.4-1.8 s on the 35B file, while a captured 512-token prefill saves about 75 ms, so
        # a one-shot run (``luce-tune generate``) is better off never capturing; 0 captures on first use
        self.prefill_capture_after = 1
        # Eager prefills of longer prompts run in chunks of this many tokens, each continuing the state (the
        # attention's lower-right causal mask, engine.model.attention): their activations stay those of one
        # chunk whatever the prompt's length (a 16K-token prompt in one forward took 2.9 GB of the H200's
        # memory beyond the cache at the 35B shapes); None: one forward
        self.prefill_chunk: int | None = prefill_chunk_setting()
        self._prefill_seen: dict[int, int] = {}  # padded length -> eager prefills counted towards its capture
        self._prefills: dict[int, "PrefillGraph"] = {}  # padded length -> captured prefill, least recent first
        self._prefill_pool = None
        self._prefill_state: "ModelState | None" = None  # the captured prefills' one state (the longest length)

    @property
    def config(self):
        return self.model.cfg

    @classmethod
    def from_gguf(cls, path: str | Path, *, device: str | torch.device = "auto",
                  dtype: str | torch.dtype | None = None, threads: int | None = None,
                  stall_timeout_s: float = 120.0, expert_budget_mb: float | None = None,
                  routing_stats: str | Path | None = None, drafter: str | Path | None = None,
                  pflash_threshold: int | None = None, draft: str | Path | None = None,
                  cold_format: str = "dense", weights: str = "dense", cuda_graph: bool = True,
                  hot_format: str = "dense", cold_device: str = "cpu", cold_cpu_share: float | None = None,
                  cold_cpu_int8: bool | None = None, placement_unit: str | None = None,
                  cold_prefetch: int | None = None, cold_warm: int | None = None, **options: Any) -> "Engine":
        """Load a qwen35moe GGUF file.

        ``expert_budget_mb`` places the routed experts hybrid (hot ones on the GPU within the
        budget, cold ones on CPU threads) using the routing statistics beside the model (or
        ``routing_stats``); ``cold_format="quantized"`` keeps the cold experts in their GGUF
        quantized form on the host, computed by torch's CPU weight-only kernels, and
        ``hot_format="quantized"`` (with it) the hot experts on the device too, run by the
        quantized-expert kernels, the budget then counting quantized bytes; ``cold_device="gpu"``
        has the GPU compute the cold experts, reading their pinned host copies over the bus
        (``engine.hybrid``), so a step with cold experts needs no host and can be captured, and
        ``cold_cpu_share`` (0 to 1, with it and a budget) hands that share of the cold experts to CPU threads
        working beside the bus in decode-sized calls (``engine.kernels.host_experts``), in 8-bit activations
        unless ``cold_cpu_int8=False`` (default ``LUCE_TUNE_COLD_CPU_INT8`` or on); ``placement_unit`` (default
        ``LUCE_TUNE_PLACEMENT_UNIT`` or ``"expert"``) is what the hot set grows by: single experts by routed
        mass, or whole layers (``"layer"``: fewer layers with cold experts, as llama.cpp's ``-ncmoe``);
        ``cold_prefetch`` (with a CPU share; default ``LUCE_TUNE_COLD_PREFETCH`` or 0) has the bus fetch that many
        cold experts a layer ahead of its router from the predicted routing, and ``cold_warm`` (default
        ``LUCE_TUNE_COLD_WARM`` or 0) the CPU threads warm that many more (``set_cold_prefetch``); ``drafter``
        loads a PFlash drafter sharing the target's vocabulary;
        ``draft`` attaches a DFlash draft, checked against the target before any tensor loads.
        ``weights="quantized"`` keeps the block-quantized projection matrices (attention, Gated
        DeltaNet, shared expert, output head) in their GGUF blocks on the device, multiplied by
        the Triton dequantize-in-register kernels on CUDA (torch's reference on the CPU).
        ``cuda_graph`` (the default) lets plain decoding replay a decode step captured in a CUDA graph,
        and prompts up to 2,048 tokens a captured padded prefill, where the configuration allows it
        (``decode_graph_blocker``; on the CPU everything runs eagerly). On the H200's 35B file the
        captured step decodes at 450-470 tok/s against about 20 eagerly (docs/benchmarks.md), and its
        GPU tests give the eager path's greedy text; ``cuda_graph=False`` decodes eagerly.
        """
        if options:
            raise ConfigError(f"unknown engine option(s): {', '.join(sorted(options))}")
        if weights not in ("dense", "quantized"):
            raise ConfigError(f"weights must be 'dense' or 'quantized', got {weights!r}")
        if cold_format not in ("dense", "quantized"):
            raise ConfigError(f"cold_format must be 'dense' or 'quantized', got {cold_format!r}")
        if hot_format not in ("dense", "quantized"):
            raise ConfigError(f"hot_format must be 'dense' or 'quantized', got {hot_format!r}")
        if hot_format == "quantized" and cold_format != "quantized":
            raise ConfigError("hot_format='quantized' needs cold_format='quantized' (both tiers read the GGUF blocks)")
        if cold_device not in ("cpu", "gpu"):
            raise ConfigError(f"cold_device must be 'cpu' or 'gpu', got {cold_device!r}")
        if cold_cpu_share is not None and not 0.0 <= cold_cpu_share <= 1.0:
            raise ConfigError(f"cold_cpu_share must be between 0 and 1, got {cold_cpu_share}")
        if cold_cpu_share and (cold_device != "gpu" or expert_budget_mb is None):
            raise ConfigError("cold_cpu_share needs cold_device='gpu' and an expert budget")
        if (cold_prefetch or cold_warm) and (cold_device != "gpu" or expert_budget_mb is None):
            raise ConfigError("cold_prefetch and cold_warm need cold_device='gpu' and an expert budget")
        if placement_unit is not None and placement_unit not in PLACEMENT_UNITS:
            raise ConfigError(f"placement_unit must be one of {', '.join(PLACEMENT_UNITS)}, got {placement_unit!r}")
        if threads is not None:
            if threads < 1:
                raise ConfigError(f"threads must be at least 1, got {threads}")
            torch.set_num_threads(threads)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        t0 = time.perf_counter()
        path = Path(path)
        with GGUFFile(path) as f:
            tokenizer = Tokenizer.from_metadata(f.metadata, source=str(path))
            draft_file = None
            if draft is not None:
                from engine.dflash.compat import open_compatible
                from engine.model.config import ModelConfig

                cfg = ModelConfig.from_metadata(f.metadata, source=str(path))
                draft_file = open_compatible(draft, cfg, target_name=path.name)
            # with a budget on the GPU the experts go to host memory (or are not read, when the
            # placement builds its quantized copies from the file): loading all of them onto the
            # device first would need a GPU as large as the whole model
            expert_device = None
            if expert_budget_mb is not None:
                expert_device = "meta" if cold_format == "quantized" else "cpu" if dev.type == "cuda" else None
            model = Qwen35MoE.from_gguf(f, device=dev, dtype=dt, quantized=weights == "quantized",
                                        expert_device=expert_device)
        if tokenizer.vocab_size > model.cfg.vocab:
            raise EngineError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the output "
                              f"layer only {model.cfg.vocab}")
        pflash = None
        draft_model = None
        if drafter is not None:
            from engine.pflash.drafter import Drafter
            from engine.pflash.select import PFlashConfig

            draft_model = Drafter.from_gguf(drafter, target_vocab=tokenizer, device=dev, dtype=dt)
            pflash = PFlashConfig() if pflash_threshold is None else PFlashConfig(threshold=pflash_threshold)
        eng = cls(path=path, model=model, tokenizer=tokenizer, device=dev, dtype=dt, load_s=0.0,
                  stall_timeout_s=stall_timeout_s,
                  routing_stats_path=Path(routing_stats) if routing_stats is not None else None,
                  drafter=draft_model, pflash=pflash, cold_format=cold_format, cuda_graph=cuda_graph,
                  hot_format=hot_format, cold_device=cold_device)
        if draft_file is not None:
            eng.draft = draft_file.load(device=dev, dtype=dt)
        if expert_budget_mb is not None:
            eng.set_expert_budget(expert_budget_mb, unit=placement_unit)
            if cold_cpu_share is not None or cold_cpu_int8 is not None:
                eng.set_cold_cpu_share(eng.hybrid.cpu_share if cold_cpu_share is None else cold_cpu_share,
                                       int8=cold_cpu_int8)
            if cold_prefetch is not None or cold_warm is not None:
                eng.set_cold_prefetch(eng.hybrid.cold_prefetch if cold_prefetch is None else cold_prefetch,
                                      warm=cold_warm)
        _sync(dev)
        eng.load_s = time.perf_counter() - t0
        return eng

    @classmethod
    def from_profile(cls, path: str | Path, *, fallback_target: str | Path | None = None,
                     device: str = "auto") -> "Engine":
        """Boot from a published profile: verify this machine's fingerprint and the model files'
        hashes, load with the profile's settings and run a short smoke generation.

        When anything does not hold, warn and load ``fallback_target`` (by default the
        profile's own target file) with the engine's defaults. ``engine.defaults`` then holds
        the generate() options the profile chose, which ``generate`` applies when not given.
        """
        from engine.boot import boot
        from engine.profile import ProfileError, load_profile

        if fallback_target is None:
            try:
                fallback_target = load_profile(path).models["target"].path
            except (ProfileError, KeyError) as exc:
                raise ProfileError(f"{path}: cannot boot from this profile and no fallback target was given "
                                   f"({exc})") from None
        result = boot(path, fallback_target=fallback_target, fallback_device=device)
        if result.fell_back:
            warnings.warn(f"profile {path} not used ({'; '.join(result.problems)}); booted {fallback_target} "
                          "with default settings", stacklevel=2)
        result.engine.defaults = dict(result.generate_options)
        return result.engine

    def set_expert_budget(self, budget_mb: float, *, unit: str | None = None) -> "Placement":
        """Place the routed experts for ``budget_mb`` MB of device memory, in place.

        The first call takes the experts over into host memory plus device slots; later calls
        move only the experts that change tier. ``unit`` (None: as set, at first
        ``LUCE_TUNE_PLACEMENT_UNIT`` or ``"expert"``): what the hot set grows by, single experts or
        whole layers (``engine.placement.plan_placement``). Returns the placement (hot/cold counts,
        bytes, expected cold-hit rate).
        """
        if budget_mb < 0:
            raise ConfigError(f"expert budget must be >= 0 MB, got {budget_mb}")
        self._graphs.clear()  # they read the device slots about to move; their memory is freed first
        self._prefills.clear()
        if self.hybrid is None:
            from engine.hybrid import attach_hybrid
            from engine.placement import load_routing_stats

            stats = load_routing_stats(self.path, self.model.cfg, self.routing_stats_path)
            if self.cold_format == "dense":
                self.hybrid = attach_hybrid(self.model, budget_mb, stats, cold_device=self.cold_device, unit=unit)
                return self.hybrid.placement
            gguf_file = GGUFFile(self.path)  # owned by the executor from here: it views the raw blocks
            try:
                self.hybrid = attach_hybrid(self.model, budget_mb, stats, cold_format="quantized",
                                            gguf_file=gguf_file, hot_format=self.hot_format,
                                            cold_device=self.cold_device, unit=unit)
            except BaseException:
                gguf_file.close()
                raise
            return self.hybrid.placement
        return self.hybrid.set_budget(budget_mb, unit)

    def set_cold_cpu_share(self, share: float, *, int8: bool | None = None, threads: int | None = None) -> None:
        """Hand ``share`` (0 to 1) of the cold experts to CPU threads working beside the bus in decode-sized
        calls (``HybridExperts.set_cpu_share``, ``int8`` their activations' width, ``threads`` how many);
        needs a placement with ``cold_device="gpu"``."""
        if self.hybrid is None:
            raise ConfigError("a CPU share of the cold experts needs an expert budget (set_expert_budget first)")
        self._graphs.clear()  # captured with the old split
        self._prefills.clear()
        self.hybrid.set_cpu_share(share, int8=int8, threads=threads)

    def set_cold_prefetch(self, n: int, *, warm: int | None = None, ahead: bool | None = None,
                          route: str | None = None, programs: int | None = None, copier: str | None = None) -> None:
        """Have the bus fetch up to ``n`` cold experts a layer ahead of its router, and the CPU threads warm
        ``warm`` more (None: as set), from its predicted routing (``HybridExperts.set_cold_prefetch``: one-token
        steps with a CPU share); 0 stops it. ``ahead`` (None: as set): a cold layer after an all-hot one is
        predicted at that layer's start; ``route`` and ``programs`` (None: as set): where the predicting router
        runs (``"main"`` or ``"side"``) and the programs of the bus's fetch (0: one a block); ``copier`` (None: as
        set): what copies that fetch (``"kernel"`` or ``"engine"``, the copy engine from a host thread)."""
        if self.hybrid is None:
            raise ConfigError("fetching cold experts ahead needs an expert budget (set_expert_budget first)")
        self._graphs.clear()  # captured with the old setting
        self.hybrid.set_cold_prefetch(n, warm=warm, ahead=ahead, route=route, programs=programs, copier=copier)

    def _ids_tensor(self, ids: Sequence[int]) -> torch.Tensor:
        if len(ids) == 0:
            raise ConfigError("the prompt is empty: at least one token id is needed")
        vocab = self.model.cfg.vocab
        bad = [i for i in ids if not 0 <= int(i) < vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] float32, from one forward over ids from an empty state."""
        x = self._ids_tensor(ids)
        state = self.model.new_state(len(ids))
        return self.model.forward(x, state, logits="all").logits.float()

    @torch.inference_mode()
    def greedy_margins(self, ids: Sequence[int], new: Sequence[int]) -> list[float]:
        """How close each greedy choice of a continuation was to a tie.

        For each token of ``new`` (a continuation of the prompt ``ids``), the gap between the
        two largest logits at its position, in units of the model dtype's rounding step at the
        largest logit (its ulp): 0 is an exact tie, a few units is a tie that rounding
        differences between a block forward and a one-token forward can break either way.
        One teacher-forced forward; logits only for ``new``'s positions.
        """
        if not ids or not new:
            raise ConfigError("greedy_margins needs a prompt and at least one continuation token")
        state = self.model.new_state(len(ids) + len(new))
        if len(ids) > 1:
            self.model.forward(self._ids_tensor(ids[:-1]), state, logits="none")
        logits = self.model.forward(self._ids_tensor([ids[-1], *new[:-1]]), state, logits="all").logits
        top = logits.float().topk(2, dim=-1).values
        exponent = torch.floor(torch.log2(top[:, 0].abs().clamp_min(torch.finfo(torch.float32).tiny)))
        ulp = torch.finfo(self.model.dtype).eps * torch.exp2(exponent)
        return ((top[:, 0] - top[:, 1]) / ulp).tolist()

    @torch.inference_mode()
    @_traced_stalls
    def generate(self, ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] | None = None, ignore_eos: bool = False,
                 pflash_keep_ratio: float | None = None, spec_len: int | None = None,
                 spec_fallback: float | str | None = None, spec_lookup: int | None = None,
                 on_token: Callable[[int, str], None] | None = None,
                 feed: Sequence[int] | None = None) -> Generation:
        """Prefill ``ids`` and decode up to ``max_new_tokens`` new tokens.

        Stops early at an end-of-sequence token (unless ``ignore_eos``, as benchmarks want) or
        when the text contains a ``stop`` string.
        ``on_token(id, text_piece)`` streams each new token as it is produced.
        ``pflash_keep_ratio`` prefills only the prompt chunks the drafter scores highest
        (prompts longer than the drafter's threshold; needs ``drafter=`` at load).
        ``spec_len`` decodes speculatively with the attached DFlash draft, verifying that many
        tokens per target forward (needs ``draft=`` at load); greedy output is unchanged.
        ``spec_fallback``: the acceptance length under which plain decoding takes a stretch of the
        generation before speculation is tried again (default 1.2; 0: speculate throughout;
        ``"auto"``: where speculation commits tokens more slowly than timed plain steps).
        ``spec_lookup``: a match length (default 0, off): where the last that many committed ids
        occurred before, a block copies what followed them instead of the draft's proposal
        (``engine.dflash.lookup``; the output is unchanged).
        ``feed`` (benchmarks): decode these tokens in place of the sampled ones, each step still computing
        and sampling its logits; the output's ids are the fed tokens. llama-bench times decoding this way on
        random tokens, whose routing changes at every step where a random-weight model's greedy output
        repeats one token and routes it the same way every step.
        """
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if feed is not None and len(feed) < max_new_tokens:
            raise ConfigError(f"feed holds {len(feed)} tokens for {max_new_tokens} new tokens")
        if feed is not None and (bad := [t for t in feed[:max_new_tokens] if not 0 <= t < self.config.vocab]):
            raise ConfigError(f"feed holds token ids outside the vocabulary of {self.config.vocab}: {bad[:4]}")
        blocking = blocking_wait_setting()  # before the prefill
        if pflash_keep_ratio is None:
            pflash_keep_ratio = self.defaults.get("pflash_keep_ratio")
        if spec_len is None and self.draft is not None:
            spec_len = self.defaults.get("spec_len")
        if spec_len is not None and self.draft is None:
            raise ConfigError("spec_len needs a DFlash draft: load the engine with draft=PATH")
        if feed is not None and spec_len is not None:
            raise ConfigError("feed and spec_len do not go together: speculation commits the target's own tokens")
        from engine.dflash.speculative import DEFAULT_FALLBACK, check_fallback

        if spec_fallback is None:
            spec_fallback = self.defaults.get("spec_fallback", DEFAULT_FALLBACK)
        if spec_lookup is None:
            spec_lookup = self.defaults.get("spec_lookup", 0)
        from engine.dflash.lookup import check_min_match

        try:
            check_min_match(spec_lookup)
        except ValueError as exc:
            raise ConfigError(f"spec_lookup: {exc}") from None
        try:
            check_fallback(spec_fallback)  # before the prefill
        except ValueError:
            raise ConfigError(f"spec_fallback must be >= 0 (0: no plain stretches) or 'auto', "
                              f"got {spec_fallback!r}") from None
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
        prompt = self._ids_tensor(ids)
        gen = make_generator(params, self.device)
        eos = set() if ignore_eos else set(self.tokenizer.eos_ids)
        stop = list(stop or [])
        if pflash_keep_ratio is not None and self.drafter is None:
            raise ConfigError("pflash_keep_ratio needs a drafter: load the engine with drafter=PATH")
        extra: dict[str, Any] = {"decode_path": "eager"}
        decoder = padded = None
        # before the counters are reset: a capture's warm-up routes tokens through the experts
        if spec_len is None and max_new_tokens > 1:
            decoder = self._decode_graph(len(ids) + max_new_tokens, extra)
        if spec_len is None and pflash_keep_ratio is None:
            padded = self._prefill_graph(len(ids), extra)
        _reset_peak(self.device)
        if self.hybrid is not None:
            self.hybrid.reset_counters()

        t0 = time.perf_counter()
        if pflash_keep_ratio is not None:
            from engine.pflash.prefill import compressed_prefill

            capture = tuple(self.draft.cfg.target_layer_ids) if spec_len is not None else ()
            res = compressed_prefill(self.model, prompt, drafter=self.drafter, keep_ratio=pflash_keep_ratio,
                                     config=self.pflash, reserve=max_new_tokens + (spec_len or 0),
                                     capture_layers=capture)
            state, last_logits = res.state, res.logits
            if decoder is not None:  # the static step is bound to its own state: continue from a copy
                decoder.state.copy_from(state)
                state = decoder.state
            extra.update(res.timings())
            if spec_len is not None:
                return self._speculative(ids, max_new_tokens, params, eos, stop, spec_len, on_token, extra,
                                         t0, prefilled=res, fallback=spec_fallback, lookup=spec_lookup)
        elif spec_len is not None:
            return self._speculative(ids, max_new_tokens, params, eos, stop, spec_len, on_token, extra, t0,
                                     fallback=spec_fallback, lookup=spec_lookup)
        else:
            if padded is not None:
                last_logits, state = padded.run(prompt)
                if decoder is not None:  # the static step is bound to its own state: continue from a copy
                    decoder.state.copy_from(state)
                    state = decoder.state
            else:
                if decoder is not None:
                    state = decoder.state
                    state.reset()
                else:
                    state = self.model.new_state(len(ids) + max_new_tokens)
                last_logits = self._prefill_chunked(prompt, state, extra)
        token = sample(last_logits, params, gen)
        fed = None
        if feed is not None:
            fed = torch.tensor(list(feed[:max_new_tokens]), dtype=torch.long, device=self.device)
            token = fed[0]
        new = [int(token)]  # the first token: read at once (time to first token)
        t1 = time.perf_counter()
        stream = _TextStream(self.tokenizer, on_token)
        stream.push(new[-1])
        reason = self._stop_reason(new, stream.text, eos, stop)
        last = t1
        # Each step is launched before the token of the step before is read back: the device never
        # waits on the host's reading, streaming and stop checks. A generation that stops at an
        # end-of-sequence token or a stop string has launched one step more, whose token is dropped.
        reader = _TokenReader(self.device, blocking=blocking)
        pending = None  # the slot of a token launched and not yet read
        while reason is None and len(new) + (pending is not None) < max_new_tokens:
            if decoder is not None:
                logits = decoder.step(token.reshape(1))[-1]
            else:
                logits = self.model.forward(token.reshape(1), state, logits="last").logits[-1]
            token = sample(logits, params, gen)
            if fed is not None:
                token = fed[len(new) + (pending is not None)]
            slot = reader.put(token)
            if pending is not None:
                reason, last = self._take(reader.get(pending), new, stream, eos, stop, last)
            pending = slot
        if reason is None and pending is not None:
            reason, last = self._take(reader.get(pending), new, stream, eos, stop, last)
        t2 = time.perf_counter()

        text = self.tokenizer.decode(new)
        if reason == "stop":
            text = _cut_at_stop(text, stop)
        decode_s = t2 - t1
        timings = Timings(
            prompt_tokens=len(ids), new_tokens=len(new), prefill_s=t1 - t0, decode_s=decode_s,
            decode_tok_s=(len(new) - 1) / decode_s if len(new) > 1 and decode_s > 0 else 0.0,
            peak_mem_mb=_peak_mb(self.device), extra=_with_fallbacks(extra))
        if self.hybrid is not None:
            timings.extra.update(self.hybrid.stats_snapshot().as_dict())
        return Generation(ids=new, text=text, timings=timings, stop_reason=reason or "length")

    def _prefill_chunked(self, prompt: torch.Tensor, state: "ModelState", extra: dict[str, Any]) -> torch.Tensor:
        """The last prompt token's logits after prefilling ``prompt`` into ``state`` eagerly, in chunks of
        ``prefill_chunk`` tokens (one forward when it is None or the prompt fits one chunk)."""
        chunk = prompt.shape[0] if self.prefill_chunk is None else self.prefill_chunk
        if chunk < 1:
            raise ConfigError(f"prefill_chunk must be at least 1 token, got {chunk}")
        starts = range(0, prompt.shape[0], chunk)
        for start in starts[:-1]:
            self.model.forward(prompt[start:start + chunk], state, logits="none")
        if len(starts) > 1:
            extra["prefill_chunks"] = len(starts)
        return self.model.forward(prompt[starts[-1]:], state, logits="last").logits[-1]

    def _take(self, token: int, new: list[int], stream: "_TextStream", eos: set[int], stop: list[str],
              last: float) -> tuple[str | None, float]:
        """Append a token read back from the device, stream it and check for a stop: (the stop reason or
        None, the time of this progress). A generation that made no progress for ``stall_timeout_s``
        raises ``GenerationStalled``."""
        new.append(token)
        if self.hybrid is not None and self.hybrid.cpu_share:
            self.hybrid.check_cpu_share()  # a host word: the threads' or the device's wait's failure
        now = time.perf_counter()
        if now - last > self.stall_timeout_s:
            raise GenerationStalled(f"generation made no progress for {now - last:.0f} s "
                                    f"(limit {self.stall_timeout_s:.0f} s) at token {len(new)}")
        stream.push(token)
        return self._stop_reason(new, stream.text, eos, stop), now

    def decode_graph_blocker(self) -> str | None:
        """Why plain decoding runs eagerly, or None when it uses the static decode step
        (replayed from a CUDA graph)."""
        if not self.cuda_graph:
            return "the engine was loaded with cuda_graph=False"
        if "decode" in self._capture_failures:
            return self._capture_failures["decode"]
        from engine.model.decode_graph import graph_blocker

        return graph_blocker(self.model)

    def _decode_graph(self, tokens: int, extra: dict[str, Any]) -> "DecodeGraph | None":
        """The cached static decode step for ``tokens`` prompt + new tokens, captured on first
        use; None (and the reason in ``extra``) when decoding stays eager."""
        blocker = self.decode_graph_blocker()
        if blocker is not None:
            extra["decode_graph_blocker"] = blocker
            return None
        from engine.model.decode_graph import DecodeGraph

        capacity = graph_capacity(tokens)
        decoder = self._cached("decode", self._graphs, capacity, MAX_DECODE_GRAPHS,
                               lambda: DecodeGraph(self.model, self.model.new_state(capacity)), extra)
        if decoder is not None:
            extra["decode_path"] = decoder.path
        return decoder

    def _cached(self, kind: str, cache: dict[int, Any], key: int, limit: int, build: Callable[[], Any],
                extra: dict[str, Any]) -> Any:
        """``cache[key]`` (a captured ``kind`` step: decode or prefill) while it is ``current()``, else a new one
        from ``build`` (the least recently used dropped past ``limit``), made the most recently used; the
        seconds building took go to ``extra[f"{kind}_graph_capture_s"]``. A build that raises
        ``RuntimeError`` (an op that cannot be captured) returns None, warns once and is remembered: that
        path runs eagerly from then on, ``extra[f"{kind}_graph_blocker"]`` saying why."""
        item = cache.pop(key, None)
        if item is None or not item.current():
            while len(cache) >= limit:
                del cache[next(iter(cache))]
            t0 = time.perf_counter()
            try:
                item = build()
            except RuntimeError as exc:
                what = "the decode step" if kind == "decode" else "the prefill"
                self._capture_failures[kind] = f"capturing {what} failed: {exc}"
                warnings.warn(self._capture_failures[kind], stacklevel=4)
                extra[f"{kind}_graph_blocker"] = self._capture_failures[kind]
                return None
            _sync(self.device)
            extra[f"{kind}_graph_capture_s"] = time.perf_counter() - t0
        cache[key] = item
        return item

    def _prefill_graph(self, tokens: int, extra: dict[str, Any]) -> "PrefillGraph | None":
        """The cached captured prefill of the padded length that holds ``tokens``, captured once that length
        has prefilled eagerly ``prefill_capture_after`` times; None (prefill eagerly) until then, without
        ``cuda_graph``, where the decode step could not be captured either, past the longest padded length,
        or after a capture failed. ``extra["prefill_path"]`` says which."""
        from engine.model.prefill_graph import BUCKETS, PrefillGraph, applies, bucket_for

        extra["prefill_path"] = "eager"
        bucket = bucket_for(tokens)
        if (not self.prefill_graph or bucket is None or "prefill" in self._capture_failures
                or self.decode_graph_blocker() is not None or not applies(self.model.executor)):
            return None
        cached = self._prefills.get(bucket)
        if (cached is None or not cached.current()) and self._prefill_seen.get(bucket, 0) < self.prefill_capture_after:
            self._prefill_seen[bucket] = self._prefill_seen.get(bucket, 0) + 1
            return None
        if self._prefill_pool is None and self.device.type == "cuda":
            self._prefill_pool = torch.cuda.graph_pool_handle()

        def build() -> PrefillGraph:
            if self._prefill_state is None:
                self._prefill_state = self.model.new_state(BUCKETS[-1])
            return PrefillGraph(self.model, bucket, pool=self._prefill_pool, state=self._prefill_state)

        padded = self._cached("prefill", self._prefills, bucket, MAX_PREFILL_GRAPHS, build, extra)
        if padded is None:
            return None
        extra["prefill_path"] = "cuda_graph" if padded.captured else "padded"  # padded: run eagerly (tests)
        extra["prefill_padded_to"] = bucket
        return padded

    def _speculative(self, ids: Sequence[int], max_new_tokens: int, params: SamplingParams, eos: set[int],
                     stop: list[str], spec_len: int, on_token: Callable[[int, str], None] | None,
                     extra: dict[str, Any], t0: float, prefilled: Any = None, *,
                     fallback: float | str, lookup: int = 0) -> Generation:
        from engine.dflash.speculative import speculative_generate

        stream = _TextStream(self.tokenizer, on_token)

        def stopped(new: list[int]) -> bool:
            stream.push(new[-1])
            return bool(stop) and any(s in stream.text for s in stop)

        new, stats = speculative_generate(
            self.model, self.draft, ids, max_new_tokens, spec_len=spec_len, temperature=params.temperature,
            top_p=params.top_p, seed=params.seed, eos_ids=eos, stop=stopped,
            stall_timeout_s=self.stall_timeout_s, prefilled=prefilled, fallback_threshold=fallback, lookup=lookup,
            # nothing is captured on the CPU: verify eagerly there (the fixed-shape step attends over its whole cache)
            verify_path="graph" if self.cuda_graph and self.device.type == "cuda" else "eager")
        text = self.tokenizer.decode(new)
        if stats.stop_reason == "stop":
            text = _cut_at_stop(text, stop)
        prefill_s = (time.perf_counter() - t0) - stats.decode_s  # PFlash's selection included
        extra.update({f"dflash_{k}" if k in ("prefill_s", "decode_s", "new_tokens", "prompt_tokens", "stop_reason")
                      else k: v for k, v in stats.as_dict().items() if k != "accept_lengths"})
        timings = Timings(
            prompt_tokens=len(ids), new_tokens=len(new), prefill_s=prefill_s, decode_s=stats.decode_s,
            decode_tok_s=(len(new) - 1) / stats.decode_s if len(new) > 1 and stats.decode_s > 0 else 0.0,
            peak_mem_mb=_peak_mb(self.device), extra=_with_fallbacks(extra))
        if self.hybrid is not None:
            timings.extra.update(self.hybrid.stats_snapshot().as_dict())
        return Generation(ids=new, text=text, timings=timings, stop_reason=stats.stop_reason)

    @staticmethod
    def _stop_reason(new: list[int], text: str, eos: set[int], stop: list[str]) -> str | None:
        if new[-1] in eos:
            return "eos"
        if stop and any(s in text for s in stop):
            return "stop"
        return None


class _TextStream:
    """Turns token ids into text pieces without splitting multi-byte characters.

    Only the ids since the last complete piece are decoded each time, so streaming stays
    linear in the number of tokens (byte-level BPE: the text is the concatenated bytes).
    """

    def __init__(self, tokenizer: Tokenizer, on_token: Callable[[int, str], None] | None) -> None:
        self.tokenizer = tokenizer
        self.on_token = on_token
        self.pending: list[int] = []
        self.text = ""

    def push(self, token: int) -> None:
        self.pending.append(token)
        piece = self.tokenizer.decode(self.pending)
        if piece.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            piece = ""
        else:
            self.pending.clear()
            self.text += piece
        if self.on_token is not None:
            self.on_token(token, piece)


class _TokenReader:
    """Sampled token ids copied to the host without waiting: ``put`` queues the copy of a device token into
    one of two pinned buffers (on CUDA) and returns its slot, ``get`` waits for that copy alone and reads
    it. Two slots: a decode loop reads each token after it has queued the next step. ``blocking``: the wait
    sleeps until the copy is done rather than spinning (``torch.cuda.Event(blocking=True)``).

    The events are created, recorded and waited on once here, before the loop launches a step: a driver call
    made while a step runs must not wait for the device, since the step's cold layers wait on the copy engine's
    copier, whose copies need the driver too (a first use of a blocking event inside the loop is suspected of
    such a wait: docs/benchmarks.md, twenty-seventh round). A blocking wait on an event already passed returns
    at once, so that did not make the process's first blocking wait while the device is busy (twenty-eighth
    round): once per process and device, each event is recorded behind a short spin on the device
    (``WARM_SPIN_CYCLES``) and waited on, so that the first such wait falls here, while no step runs."""

    WARM_SPIN_CYCLES = 1 << 20  # about 0.5 ms on an H100
    _warmed: set[torch.device] = set()

    def __init__(self, device: torch.device, blocking: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.blocking = blocking and self.cuda
        self.bufs = [torch.empty((), dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self.events = [torch.cuda.Event(blocking=self.blocking) if self.cuda else None for _ in range(2)]
        busy = self.blocking and device not in _TokenReader._warmed
        for event in self.events:
            if event is not None:
                if busy:
                    torch.cuda._sleep(self.WARM_SPIN_CYCLES)
                event.record()
                event.synchronize()
        if busy:
            _TokenReader._warmed.add(device)
        self.next = 0

    def put(self, token: torch.Tensor) -> int:
        slot, self.next = self.next, 1 - self.next
        self.bufs[slot].copy_(token.reshape(()), non_blocking=self.cuda)
        if self.cuda:
            self.events[slot].record()
        return slot

    def get(self, slot: int) -> int:
        if self.cuda:
            self.events[slot].synchronize()
        return int(self.bufs[slot])


def _cut_at_stop(text: str, stop: list[str]) -> str:
    cut = min((text.find(s) for s in stop if s in text), default=len(text))
    return text[:cut]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _with_fallbacks(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` with the fused kernels this process switched off, when there are any: a
    measurement then says that it ran their torch paths."""
    from engine.kernels import fused

    if fused.failures():
        extra["fused_kernels_off"] = ", ".join(sorted(fused.failures()))
    return extra


def _peak_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated since the reset, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
