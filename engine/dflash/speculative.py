"""DFlash speculative decoding: draft a block, verify it in one target forward, keep the
longest agreeing prefix plus the target's own next token, roll the target state back.

Output is the target's: greedy output equals plain greedy decoding, and sampled output has
the target's distribution, because every committed token is the target's own choice (or
sample) given the committed prefix; the draft only decides how many of them one forward
yields. The loop synchronises with the host once per verify step (the accepted count and
the committed ids travel together).
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Collection, Sequence

import torch
import torch.nn.functional as F

from engine.dflash.compat import check_spec_len
from engine.dflash.device_loop import LAG, MAX_LAG, room_steps
from engine.dflash.draft import DFlashDraft, DraftCache, block_hidden
from engine.dflash.lookup import check_min_match, merge_lookup
from engine.dflash.rollback import ROLLBACK_MODES, make_rollback
from engine.errors import ConfigError, GenerationStalled
from engine.model.qwen35moe import Qwen35MoE
from engine.sampling import SamplingParams, make_generator, sample
from engine.model.linear import linear

# bench/dflash.py, tiny target on the CPU, random draft, spec_len 4 and 8, both budgets: rollback
# cost per verify step 0.9-1.9 ms with "capture" against 4.2-8.5 ms with "recompute" (which runs
# the target again over the kept tokens, experts included).
DEFAULT_ROLLBACK = "capture"
# How the target runs a verify block of spec_len tokens: "eager" (``Qwen35MoE.forward`` and the
# rollback above), "static" (the fixed-shape step of ``engine.model.decode_graph`` with its own
# rollback, run eagerly), "graph" (the same step replayed from a CUDA graph, one per spec_len;
# "static" where the configuration cannot be captured).
VERIFY_PATHS = ("eager", "static", "graph")
REPROBE_GROWTH = 8  # a plain stretch after repeated failed tries grows to at most this many times reprobe_after
REPROBE_WINDOW = 2  # verify steps after which a new try is first judged (a failed try costs this many)
# fallback_threshold="auto": the generation opens with this many plain steps, which time the plain
# rate; a window of verify steps then falls back when it commits tokens more slowly than that rate
CALIBRATION_STEPS = 4
# The acceptance length under which plain decoding takes a stretch. On the H200 table of 2026-12-01
# it took prose from 0.22-0.49x of plain decoding (pure speculation) to 0.74-0.85x, code from
# 0.48-0.76x to 0.84-1.08x.
DEFAULT_FALLBACK = 1.2


def check_fallback(value: float | str) -> None:
    """A fallback threshold is a non-negative acceptance length (0: never) or ``"auto"``."""
    if value != "auto" and (isinstance(value, str) or not value >= 0):  # NaN too
        raise ValueError(f"fallback_threshold must be >= 0 or 'auto', got {value!r}")


def dflash_slower(accept_lengths: Sequence[int], step_s: Sequence[float], plain_s: Sequence[float]) -> bool:
    """Whether verify steps that committed ``accept_lengths`` tokens in ``step_s`` seconds each
    made fewer tokens per second than plain steps of ``plain_s`` seconds (their median)."""
    return sum(accept_lengths) / max(sum(step_s), 1e-12) < 1.0 / max(_median(plain_s), 1e-12)


@dataclass(frozen=True)
class SpecOptions:
    """How one speculative generation runs."""

    spec_len: int  # tokens verified per target forward: the last committed token + spec_len - 1 drafted
    rollback: str = DEFAULT_ROLLBACK
    fallback_threshold: float | str = DEFAULT_FALLBACK  # acceptance length under which plain decoding takes over; 0: never;
                                           # "auto": where speculation commits tokens slower than plain steps
    fallback_window: int = 8  # verify steps the running acceptance length is taken over
    reprobe_after: int = 32  # plain tokens before speculation is tried again (doubling after each failed try,
                             # up to REPROBE_GROWTH times); 0: plain decoding to the end
    stall_timeout_s: float = 120.0  # longest time without a committed token
    verify_path: str = "eager"  # see VERIFY_PATHS
    device_loop: bool = True  # greedy, fixed-shape verify: steps advance their own counters on the device
                              # (engine.dflash.device_loop) and the host reads each one a step late
    restore: str = "auto"  # the fixed-shape verify's state restore (engine.model.decode_graph.RESTORES)
    lag: int = LAG  # the device loop's steps launched past the one the host waits for (0..MAX_LAG)
    lookup: int = 0  # match length of the committed-text lookup whose copy replaces the draft's block; 0: off

    def __post_init__(self) -> None:
        if self.verify_path not in VERIFY_PATHS:
            raise ValueError(f"verify_path must be one of {VERIFY_PATHS}, got {self.verify_path!r}")
        if self.rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback must be one of {ROLLBACK_MODES}, got {self.rollback!r}")
        from engine.model.decode_graph import RESTORES

        if self.restore not in RESTORES:
            raise ValueError(f"restore must be one of {RESTORES}, got {self.restore!r}")
        if not 0 <= self.lag <= MAX_LAG:
            raise ValueError(f"lag must be 0..{MAX_LAG}, got {self.lag}")
        check_min_match(self.lookup)
        check_fallback(self.fallback_threshold)
        if self.fallback_window < 1:
            raise ValueError(f"fallback_window must be at least 1, got {self.fallback_window}")
        if self.reprobe_after < 0:
            raise ValueError(f"reprobe_after must be >= 0, got {self.reprobe_after}")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}")


@dataclass
class SpecStats:
    """What a speculative generation measured (seconds; device time on CUDA)."""

    spec_len: int
    rollback: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0
    verify_steps: int = 0
    spec_tokens: int = 0  # tokens committed by verify steps
    drafted: int = 0
    accepted: int = 0  # drafted tokens the target agreed with
    rollbacks: int = 0  # verify steps that kept fewer tokens than they ran
    fallback: bool = False  # plain decoding took over at least once
    fallback_at: int | None = None  # new-token count when plain decoding first took over
    fallbacks: int = 0  # times plain decoding took over (speculation is tried again after a stretch)
    plain_steps: int = 0  # target forwards of one token (after a fallback, or a last single token)
    plain_path: str = "eager"  # the path those forwards took: eager, static or cuda_graph
    step_ms: float = 0.0  # median wall time of a verify step (draft, verify, rollback, commit)
    plain_step_ms: float = 0.0  # median wall time of a plain step (0 when none ran)
    stop_reason: str = "length"
    verify_path: str = "eager"  # the path full verify blocks took (a shorter last block runs eagerly)
    verify_path_note: str | None = None  # why a requested graph was not captured
    draft_path: str = "eager"  # the path full blocks' proposals took: eager, static or cuda_graph
    restore: str | None = None  # the fixed-shape verify's state restore: "states" or "replay" (None: eager verify)
    device_loop: bool = False  # verify steps ran back to back on the device, the host reading them a step late
    lookup: int = 0  # the committed-text lookup's match length (0: the draft's blocks only)
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed by each verify step

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per verify forward (1.0: the draft never helped)."""
        return self.spec_tokens / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["acceptance_length"] = self.acceptance_length
        d["draft_accept_rate"] = self.accepted / self.drafted if self.drafted else 0.0
        return d


def _median(values: Sequence[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


class _Clock:
    """Wall time on the CPU; CUDA events on the GPU, read once at the end (no syncs in the loop)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {}

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, name: str, start: Any, end: Any) -> None:
        self.spans.setdefault(name, []).append((start, end))

    def total(self, name: str) -> float:
        spans = self.spans.get(name, [])
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1000
        return sum(b - a for a, b in spans)


@torch.inference_mode()
def speculative_generate(model: Qwen35MoE, draft: DFlashDraft, ids: Sequence[int], max_new_tokens: int, *,
                         spec_len: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                         eos_ids: Collection[int] = (), stop: Callable[[list[int]], bool] | None = None,
                         rollback: str = DEFAULT_ROLLBACK, fallback_threshold: float | str = DEFAULT_FALLBACK,
                         fallback_window: int = 8, reprobe_after: int = 32, stall_timeout_s: float = 120.0,
                         prefilled: Any = None, verify_path: str = "eager", device_loop: bool = True,
                         restore: str = "auto", lag: int = LAG, lookup: int = 0) -> tuple[list[int], SpecStats]:
    """Generate up to ``max_new_tokens`` after ``ids`` with ``draft`` proposing blocks.

    ``stop(new_ids)`` is called after every committed token, in order (streaming can live
    there); True ends the generation at that token, as does a token in ``eos_ids``. Returns the
    new ids and the statistics. ``spec_len`` (2 .. the draft's block size) tokens are verified
    per step. When the acceptance length over the last ``fallback_window`` verify steps falls
    under ``fallback_threshold``, plain decoding takes over (``stats.fallback``) for
    ``reprobe_after`` tokens, then speculation is tried again; each further fallback doubles the
    plain stretch (up to ``REPROBE_GROWTH`` times). A new try is first judged after
    ``REPROBE_WINDOW`` verify steps (a failed one costs only those), then over the usual window.
    ``reprobe_after=0`` decodes plainly to the end. ``fallback_threshold="auto"`` judges by time
    instead: the generation opens with ``CALIBRATION_STEPS`` plain steps, and a window of verify
    steps falls back when it commits fewer tokens per second than those plain steps (the
    break-even acceptance of the hardware at hand rather than a fixed one).
    Plain steps run through a fixed-shape one-token step (captured with ``verify_path="graph"``)
    and keep the draft's context: their captured target layers join the draft cache on resuming.

    ``verify_path`` (``VERIFY_PATHS``) runs full verify blocks through the fixed-shape decode
    step, replayed from a CUDA graph with ``"graph"`` where the configuration allows it. There, greedy
    generations run the device loop (``engine.dflash.device_loop``, ``device_loop=False``: the host loop):
    each step advances its own counters on the device, and the host reads its result a step late.
    ``restore`` (``engine.model.decode_graph.RESTORES``): how that step's Gated DeltaNet states go back to
    an accepted prefix (``stats.restore`` names the one used); ``lag``: the device loop's steps launched past
    the one whose result the host waits for.

    ``lookup`` (a match length, 0: off): where the last ``lookup`` committed ids occurred before, the block
    copies what followed that latest occurrence (``engine.dflash.lookup``) instead of the draft's proposal;
    verification is unchanged, so the output is too.

    ``prefilled`` continues from a prompt already prefilled elsewhere (PFlash's
    ``CompressedPrefill``, made with ``capture_layers`` = the draft's target layers and
    ``reserve`` >= ``max_new_tokens + spec_len``): its state, last logits, captured hidden
    states and kept positions replace the loop's own prefill.
    """
    try:
        opts = SpecOptions(spec_len=spec_len, rollback=rollback, fallback_threshold=fallback_threshold,
                           fallback_window=fallback_window, reprobe_after=reprobe_after,
                           stall_timeout_s=stall_timeout_s, verify_path=verify_path, device_loop=device_loop,
                           restore=restore, lag=lag, lookup=lookup)
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_spec_len(spec_len, draft.cfg)
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if len(ids) == 0:
        raise ConfigError("the prompt is empty: at least one token id is needed")
    return _Generation(model, draft, list(ids), max_new_tokens, opts, params, set(eos_ids), stop, prefilled).run()


class _Generation:
    def __init__(self, model: Qwen35MoE, draft: DFlashDraft, ids: list[int], max_new: int, opts: SpecOptions,
                 params: SamplingParams, eos: set[int], stop: Callable[[list[int]], bool] | None,
                 prefilled: Any = None) -> None:
        self.model, self.draft, self.opts, self.params = model, draft, opts, params
        self.prompt = torch.tensor(ids, dtype=torch.long, device=model.device)
        self.max_new = max_new
        self.eos, self.stop = eos, stop
        self.layer_ids = tuple(draft.cfg.target_layer_ids)
        self.mask = draft.cfg.mask_token_id
        self.prefilled = prefilled
        self.loop: Any = None  # engine.dflash.device_loop.SpecLoop, built with the verify step where it applies
        wants_loop = (opts.device_loop and opts.verify_path != "eager" and params.temperature == 0
                      and prefilled is None)
        if prefilled is not None:
            missing = set(self.layer_ids) - set(prefilled.output.hidden)
            if missing:
                raise ConfigError(f"the prefill did not capture target layers {sorted(missing)} the draft reads")
            self.state = prefilled.state
            total = len(prefilled.kept_positions) + max_new
        else:
            total = len(ids) + max_new
            self.state = model.new_state(total + opts.spec_len * (room_steps(opts.lag) if wants_loop else 1))
        # room for a fixed-shape block's rows (the device loop's: for the blocks in flight too)
        self.cache = DraftCache.empty(draft, total + opts.spec_len * (room_steps(opts.lag) if wants_loop else 1))
        self.wants_loop = wants_loop
        self.rollback = make_rollback(opts.rollback, model, self.state)
        self.gen = make_generator(params, model.device)
        self.clock = _Clock(model.device)
        self.stats = SpecStats(spec_len=opts.spec_len, rollback=opts.rollback, prompt_tokens=len(ids),
                               lookup=opts.lookup)
        self.draft_step: Any = None  # the fixed-shape proposal step, with the fixed-shape verify
        self.verify_step = self._verify_step(opts.verify_path)
        self.new: list[int] = []
        self.last_progress: float | None = None  # prefill time does not count as a stall
        self.plain_left: int | None = 0  # plain tokens before speculating again; None: to the end
        self.window_start = 0  # verify steps before it belong to an earlier try (not in the fallback window)
        self.plain: Any = None  # the fixed-shape one-token step (False: eager forwards), built at the first plain step
        self.auto = opts.fallback_threshold == "auto"
        self.step_s: list[float] = []  # wall time of each verify step (the host syncs once per step)
        self.plain_s: list[float] = []  # wall time of each plain step
        if self.auto:
            self.plain_left = CALIBRATION_STEPS
        if (self.auto or opts.fallback_threshold > 0) and self.verify_step is not None:
            self.plain = self._plain_decoder()  # here, so that its capture stays out of the decode loop
        self.history: torch.Tensor | None = None  # the committed ids on the device (the lookup's), up to history_len
        self.history_len = len(ids)
        if opts.lookup:
            self.history = torch.empty(len(ids) + max_new + opts.spec_len, dtype=torch.long, device=model.device)
            self.history[:len(ids)].copy_(self.prompt)
        self.pending: list[torch.Tensor] = []  # plain steps' context rows, not yet in the draft cache
        self.pending_start = 0  # position of the first of them

    def _verify_step(self, path: str) -> Any:
        """The fixed-shape verify step for ``path``, or None for eager verification."""
        if path == "eager":
            return None
        from engine.model.decode_graph import DecodeGraph, graph_blocker

        graph = path == "graph"
        if graph:
            blocker = graph_blocker(self.model)
            if blocker is not None:
                self.stats.verify_path_note = f"verify blocks not captured: {blocker}"
                graph = False
        from engine.dflash.device_loop import SpecLoop
        from engine.dflash.draft import in_cache_blocker
        from engine.dflash.draft_step import DraftStep

        def build(graph: bool) -> tuple[Any, Any]:
            if self.wants_loop and in_cache_blocker(self.draft.cfg) is None:
                self.loop = SpecLoop(self.model, self.state, self.draft, self.cache, self.model.weights.embed,
                                     self.model.weights.output, tokens=self.opts.spec_len,
                                     layer_ids=self.layer_ids, graph=graph, restore=self.opts.restore,
                                     lag=self.opts.lag, lookup=self.opts.lookup)
                return self.loop.verify, self.loop.draft
            step = DecodeGraph(self.model, self.state, tokens=self.opts.spec_len, capture_layers=self.layer_ids,
                               graph=graph, rollback=True, restore=self.opts.restore)
            draft_step = DraftStep(self.draft, self.cache, self.model.weights.embed, self.model.weights.output,
                                   tokens=self.opts.spec_len, graph=graph and self.draft.device.type == "cuda",
                                   context=step.hidden)
            return step, draft_step

        try:
            step, self.draft_step = build(graph)
        except RuntimeError as exc:  # an op that cannot be captured: the same steps, run eagerly
            if not graph:
                raise
            self.stats.verify_path_note = f"capturing the verify or draft step failed: {exc}"
            warnings.warn(self.stats.verify_path_note, stacklevel=4)
            step, self.draft_step = build(False)
        self.stats.restore = step.restore
        if self.loop is not None:
            self.stats.device_loop = True
            self.stats.verify_path = self.stats.draft_path = self.loop.path
            return step
        step.capture_rollbacks()  # outside the decode loop's timings
        self.stats.verify_path, self.stats.draft_path = step.path, self.draft_step.path
        return step

    def run(self) -> tuple[list[int], SpecStats]:
        t0 = time.perf_counter()
        if self.prefilled is not None:
            positions = self.prefilled.kept_positions.to(self.model.device)
            self._extend_context(self.prefilled.output.hidden, positions.shape[0], positions=positions)
            logits = self.prefilled.logits
        else:
            out = self.model.forward(self.prompt, self.state, capture_layers=self.layer_ids, logits="last")
            self._extend_context(out.hidden, self.prompt.shape[0], 0)
            logits = out.logits[-1]
        token = sample(logits, self.params, self.gen)
        done = self._commit([int(token)])  # host sync: the first token
        t1 = time.perf_counter()
        self.stats.prefill_s = t1 - t0
        while not done and len(self.new) < self.max_new:
            left = self.max_new - len(self.new)
            # the fixed-shape step verifies a whole block even for the last token (the commit stops at max_new):
            # a one-token step there would capture its graph inside the decode loop; eager verification runs only
            # the tokens still wanted, and a last single one is a plain step
            n = self.opts.spec_len if self.verify_step is not None else min(self.opts.spec_len, left)
            t = time.perf_counter()
            if self.plain_left is None or self.plain_left > 0 or n < 2:
                token, done = self._plain_step(token)
                self.plain_s.append(time.perf_counter() - t)
                if self.plain_left:
                    self.plain_left -= 1
            elif self.loop is not None:
                token, done = self._loop_steps(token)
            else:
                token, done = self._spec_step(token, n)
                self.step_s.append(time.perf_counter() - t)
                self._maybe_fall_back()
        self.stats.decode_s = time.perf_counter() - t1
        self.stats.new_tokens = len(self.new)
        self.stats.draft_s = self.clock.total("draft")
        self.stats.verify_s = self.clock.total("verify")
        self.stats.rollback_s = self.clock.total("rollback")
        self.stats.step_ms = 1000 * _median(self.step_s)
        self.stats.plain_step_ms = 1000 * _median(self.plain_s)
        return self.new, self.stats

    def _spec_step(self, token: torch.Tensor, n: int) -> tuple[torch.Tensor, bool]:
        model, start = self.model, self.state.next_position  # ``token`` goes at position ``start``, not yet run
        if self.pending:  # speculation resumes: the plain stretch's rows join the draft's context
            self._extend_features(torch.cat(self.pending), self.pending_start)
            self.pending.clear()
        c0 = self.clock.mark()
        if self.draft_step is not None and n == self.draft_step.tokens:
            drafted = self.draft_step.step(token, start)  # [n - 1], a buffer the next step overwrites
        else:
            block = torch.full((n,), self.mask, dtype=torch.long, device=model.device)
            block[0] = token
            hidden = block_hidden(self.draft, self.cache, F.embedding(block, model.weights.embed), start)
            drafted = linear(hidden[1:], model.weights.output).argmax(-1)  # [n - 1]
        if self.opts.lookup:
            history = self._committed_ids()
            drafted = merge_lookup(drafted, history, history.shape[0], self.opts.lookup)
        c1 = self.clock.mark()
        verify_ids = torch.cat([token.reshape(1), drafted])
        fixed = self.verify_step is not None and n == self.verify_step.tokens
        if fixed:
            logits, hidden, rollback = self.verify_step.step(verify_ids), self.verify_step.hidden, \
                self.verify_step.rollback
        else:
            out = self.rollback.verify(verify_ids, self.layer_ids)
            logits, hidden, rollback = out.logits, out.hidden, self.rollback.rollback
        choice = sample(logits, self.params, self.gen)  # [n]: the target's token after each prefix
        agree = (drafted == choice[:-1]).long().cumprod(0).sum()
        c2 = self.clock.mark()
        row = torch.cat([agree.view(1), choice, drafted])
        # the draft cache's extension reads the block's context rows and the cache length only: it goes
        # to the device before the host waits for the acceptance, and only the count waits
        written = fixed and self.draft_step.write_block(start)
        row = row.tolist()  # the host sync of this step
        accepted = row[0]
        keep = accepted + 1  # the token that opened the block and the accepted drafts
        rollback(keep)
        if written:
            self.draft_step.count(keep)
        else:
            self._extend_context(hidden, keep, start)
        c3 = self.clock.mark()
        self.clock.add("draft", c0, c1)
        self.clock.add("verify", c1, c2)
        self.clock.add("rollback", c2, c3)

        done = self._commit_block(row[n + 1:n + 1 + accepted] + [row[1 + accepted]], n)
        return choice[accepted], done

    def _commit_block(self, committed: list[int], n: int) -> bool:
        """Commit a verify step's tokens (its accepted drafts, then the target's own) and count them; True when
        the generation ends."""
        s = self.stats
        s.verify_steps += 1
        s.drafted += n - 1
        s.rollbacks += len(committed) < n
        before = len(self.new)
        done = self._commit(committed)
        got = len(self.new) - before  # fewer than committed where the generation ended inside the block
        s.accepted += min(len(committed) - 1, got - 1)  # drafted tokens that were accepted and kept
        s.spec_tokens += got
        s.accept_lengths.append(got)
        return done

    def _loop_steps(self, token: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Verify steps from the device loop until the generation ends or plain decoding takes over: each step
        launched before the host waits for the one before it; steps still in flight when it stops are committed
        (a fallback: their tokens are the target's) or dropped (the end)."""
        loop, n = self.loop, self.opts.spec_len
        if self.pending:  # speculation resumes: the plain stretch's rows join the draft's context
            self._extend_features(torch.cat(self.pending), self.pending_start)
            self.pending.clear()
        loop.load(token, self.max_new - len(self.new), self._committed_ids() if self.opts.lookup else None)
        in_flight: deque[int] = deque()
        done = stopping = False
        t = time.perf_counter()
        while True:
            # each step commits a token at least; the last token too comes from a step (the commit stops at max_new)
            if not stopping and self.max_new - len(self.new) - len(in_flight) >= 1:
                in_flight.append(loop.launch(self.clock))
                if len(in_flight) <= self.opts.lag:
                    continue  # the device gets ``lag`` steps ahead before the host waits
            if not in_flight:
                break
            row = loop.result(in_flight.popleft())
            now = time.perf_counter()
            self.step_s.append(now - t)
            t = now
            if done:
                continue  # the generation ended: steps still in flight are dropped
            done = self._commit_block(row[1:1 + row[0]], n)
            if not stopping and not done:
                self._maybe_fall_back()
            stopping = done or self.plain_left is None or self.plain_left > 0
        if self.stats.fallbacks and stopping and not done:
            self.window_start = len(self.stats.accept_lengths)  # the steps in flight belonged to the try that failed
        return loop.store(), done

    def _committed_ids(self) -> torch.Tensor:
        """The prompt and every new token on the device (the lookup's history): the tokens committed since the last
        call are written in one copy."""
        fresh = self.new[self.history_len - self.prompt.shape[0]:]
        if fresh:
            self.history[self.history_len:self.history_len + len(fresh)].copy_(torch.tensor(fresh, dtype=torch.long))
            self.history_len += len(fresh)
        return self.history[:self.history_len]

    def _plain_step(self, token: torch.Tensor) -> tuple[torch.Tensor, bool]:
        start = self.state.next_position
        if self.plain is None:
            self.plain = self._plain_decoder()
        if self.plain is False:
            out = self.model.forward(token.reshape(1), self.state, capture_layers=self.layer_ids, logits="last")
            logits, hidden = out.logits[-1], out.hidden
        else:
            logits, hidden = self.plain.step(token.reshape(1))[-1], self.plain.hidden
        if self.plain_left is not None:  # speculation may resume: keep the token's context row
            if not self.pending:
                self.pending_start = start
            self.pending.append(torch.cat([hidden[i][:1] for i in self.layer_ids], dim=-1))
        token = sample(logits, self.params, self.gen)
        self.stats.plain_steps += 1
        return token, self._commit([int(token)])

    def _plain_decoder(self) -> Any:
        """The fixed-shape one-token step on the verify step's path (captured with it), or False
        for eager forwards (the eager verify path)."""
        if self.verify_step is None:
            return False
        from engine.model.decode_graph import DecodeGraph

        graph = self.loop.captured if self.loop is not None else self.verify_step.captured
        try:
            step = DecodeGraph(self.model, self.state, tokens=1, capture_layers=self.layer_ids, graph=graph)
        except RuntimeError:  # an op that cannot be captured: the same step, eagerly
            if not graph:
                raise
            step = DecodeGraph(self.model, self.state, tokens=1, capture_layers=self.layer_ids, graph=False)
        self.stats.plain_path = step.path
        return step

    def _extend_context(self, hidden: dict[int, torch.Tensor], rows: int, start: int = 0, *,
                        positions: torch.Tensor | None = None) -> None:
        self._extend_features(torch.cat([hidden[i][:rows] for i in self.layer_ids], dim=-1), start, positions)

    def _extend_features(self, features: torch.Tensor, start: int, positions: torch.Tensor | None = None) -> None:
        """Context rows [rows, n_features * hidden] into the draft cache, at ``positions`` or from ``start`` on."""
        if positions is None:
            positions = torch.arange(start, start + features.shape[0], device=features.device)
        self.cache.extend(self.draft, features, positions)

    def _commit(self, tokens: list[int]) -> bool:
        """Append tokens one by one; True when the generation must end at the last one appended."""
        now = time.perf_counter()
        if self.last_progress is not None and now - self.last_progress > self.opts.stall_timeout_s:
            raise GenerationStalled(f"generation made no progress for {now - self.last_progress:.3g} s "
                                    f"(limit {self.opts.stall_timeout_s:.3g} s) at token {len(self.new)}")
        self.last_progress = now
        for t in tokens:
            self.new.append(t)
            stopped = self.stop is not None and self.stop(self.new)  # called for every token: it may stream
            if t in self.eos or stopped:
                self.stats.stop_reason = "eos" if t in self.eos else "stop"
                return True
            if len(self.new) >= self.max_new:
                return True
        return False

    def _maybe_fall_back(self) -> None:
        s, opts = self.stats, self.opts
        tried = s.accept_lengths[self.window_start:]
        need = opts.fallback_window if s.fallbacks == 0 else min(opts.fallback_window, REPROBE_WINDOW)
        if (not self.auto and opts.fallback_threshold <= 0) or len(tried) < need:
            return
        recent = tried[-opts.fallback_window:]
        if self.auto:
            slower = dflash_slower(recent, self.step_s[-len(recent):], self.plain_s[-4 * CALIBRATION_STEPS:])
        else:
            slower = sum(recent) / len(recent) < opts.fallback_threshold
        if slower:
            s.fallback = True
            s.fallbacks += 1
            if s.fallback_at is None:
                s.fallback_at = len(self.new)
            growth = min(2 ** (s.fallbacks - 1), REPROBE_GROWTH)
            self.plain_left = opts.reprobe_after * growth if opts.reprobe_after else None
            self.window_start = len(s.accept_lengths)
