"""DFlash steps that follow one another on the device, the host reading each step's result one step late.

The host loop (``engine.dflash.speculative``) reads every verify step's acceptance back before it can
launch the next step: the step's start position, the KV caches' length, the draft cache's length and
the next block's opening token all follow from it. Here those live on the device as counters that a
step advances itself, so a step needs nothing from the host. One greedy step is three launches (CUDA
graphs where the configuration allows, the same functions run eagerly otherwise):

1. ``draft``: the draft's proposal after the opening token, at the counters' position and cache length
   (with ``lookup``, replaced by a copy of the committed text where its end occurred before:
   ``engine.dflash.lookup``); the verify block's ids and positions from it;
2. ``verify``: the target over the block (``DecodeGraph``'s static step), its argmax, the accepted
   prefix and the report ``[keep, choice...]`` (``keep`` = accepted drafts + 1);
3. ``advance``: the draft cache's rows for the whole block written and ``keep`` of them counted, the
   Gated DeltaNet states restored to the kept prefix with ``keep`` a device value
   (``DecodeGraph.restore_at``), the next opening token ``choice[keep - 1]`` and the counters moved on.

The host launches step ``k + lag`` before it waits for step ``k``'s report (copied to pinned memory with
an event; ``lag`` 1 by default), so the device runs the steps back to back while the host streams, checks
stops and judges the fallback. When it stops launching, the steps still in flight finish; their tokens are
committed (a fallback) or dropped (the generation ended), and ``store`` writes the counters back into the
state and the draft cache. Committed tokens are the target's own greedy choices: the output is plain greedy
decoding's, as in the host loop.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.dflash.draft import DFlashDraft, DraftCache
from engine.dflash.draft_step import DraftStep
from engine.dflash.lookup import check_min_match, merge_lookup
from engine.errors import ConfigError
from engine.model.decode_graph import DecodeGraph, capture_counted, capture_graph
from engine.model.linear import Weight
from engine.model.qwen35moe import Qwen35MoE
from engine.model.state import ModelState

LAG = 1  # steps launched past the one whose report the host waits for (SpecOptions.lag's default)
MAX_LAG = 4


def room_steps(lag: int = LAG) -> int:
    """Verify blocks of room past the generation's end that the state and the draft cache need: the steps in
    flight when the host stops, and the last block's rows."""
    return lag + 2


class SpecLoop:
    """Greedy DFlash steps of ``tokens`` with their counters on the device, over ``state`` and ``cache``.

    ``graph``: capture the three launches (CUDA), else run them eagerly (any device). ``restore``: how the
    verify step's Gated DeltaNet states go back to the kept prefix (``DecodeGraph``). ``lag``: the steps the
    host launches past the one it waits for (0..``MAX_LAG``), which sizes the report slots and the room ``load``
    asks for. ``lookup``: the match length of the committed-text lookup (0: off), whose ids the loop keeps on
    the device. Needs a draft that attends in its cache (``DraftStep.in_cache``); ``ValueError`` otherwise.
    """

    def __init__(self, model: Qwen35MoE, state: ModelState, draft: DFlashDraft, cache: DraftCache, embed: torch.Tensor,
                 output: Weight, *, tokens: int, layer_ids: tuple[int, ...], graph: bool, restore: str = "auto",
                 lag: int = LAG, lookup: int = 0) -> None:
        if not 0 <= lag <= MAX_LAG:
            raise ValueError(f"the device loop's lag must be 0..{MAX_LAG}, got {lag}")
        check_min_match(lookup)
        self.state, self.cache, self.tokens, self.lag, self.lookup = state, cache, tokens, lag, lookup
        self.verify = DecodeGraph(model, state, tokens=tokens, capture_layers=layer_ids, graph=False, rollback=True,
                                  restore=restore)
        self.draft = DraftStep(draft, cache, embed, output, tokens=tokens, graph=False, context=self.verify.hidden)
        if not self.draft.in_cache:
            raise ValueError("the device loop needs a draft that attends in its cache (non-causal, full attention)")
        dev = model.device
        d, v = self.draft, self.verify
        with torch.inference_mode():
            # The counters are views of one buffer (the advance moves all three in one launch), and the draft's
            # and the verify step's own inputs are views of them, so that no launch copies one into the other:
            # the draft reads its start and cache length, the verify its cache length, and the drafted ids are
            # written straight into the verify block, whose first id is the opening token.
            self._counters = torch.zeros(4, dtype=torch.long, device=dev)
            # block start, KV length, draft cache, committed ids (the lookup's history)
            self.pos, self.kv_len, self.draft_len, self.hist_len = self._counters.unbind(0)
            # committed ids, with room for the blocks in flight (the lookup only)
            self.history = torch.zeros(cache.max_len + (room_steps(lag) + 1) * tokens if lookup else 1,
                                       dtype=torch.long, device=dev)
            self._hist_offsets = torch.arange(tokens, device=dev)
            d.start = d._context_start = self.pos  # the block's start is where the next extension's rows go
            d.length, v.cache_len = self.draft_len, self.kv_len
            d.drafted = v.ids[1:]
            self.token = v.ids[0]  # the next block's opening token
            self.report = torch.zeros(tokens + 1, dtype=torch.long, device=dev)  # [keep, choice...]
            self.keep = self.report[0]
            self._slots = torch.zeros(lag + 2, tokens + 1, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._events: list[Any] = [None] * self._slots.shape[0]
        self._launched = 0
        self._start = (0, 0)  # the host's KV length and seq_len at load
        self.graphs: tuple[torch.cuda.CUDAGraph, ...] | None = None
        self._replay_counts: list[int] | None = None
        if graph:
            self.graphs, self._replay_counts = self._capture()

    @property
    def captured(self) -> bool:
        return self.graphs is not None

    @property
    def path(self) -> str:
        return "cuda_graph" if self.captured else "static"

    @torch.inference_mode()
    def load(self, token: torch.Tensor, new_left: int, history: torch.Tensor | None = None) -> None:
        """Start from the host's view of the state and the draft cache: ``token`` (one id on the device) opens the
        next block; at most ``new_left`` more tokens are wanted. The KV caches and the draft cache need room for
        them and ``room_steps(lag)`` blocks more (steps in flight when the host stops, and the last block's rows).
        With ``lookup``, ``history`` holds every committed id (prompt and new ones, ending with ``token``'s)."""
        kv_len, draft_len = self.verify._cache_length(), self.cache.length
        room = new_left + room_steps(self.lag) * self.tokens
        if kv_len + room > self.state.max_len or draft_len + room > self.cache.max_len:
            raise ConfigError(f"the device loop needs room for {room} more tokens: the KV caches hold "
                              f"{self.state.max_len} ({kv_len} used), the draft cache {self.cache.max_len} "
                              f"({draft_len} used)")
        if self.lookup:
            if history is None:
                raise ValueError("the device loop's lookup needs the committed ids at load")
            if len(history) + new_left + room_steps(self.lag) * self.tokens > self.history.shape[0]:
                raise ConfigError(f"the device loop's lookup holds {self.history.shape[0]} ids; {len(history)} "
                                  f"committed and {new_left} more do not fit")
            self.history[:len(history)].copy_(history)
            self.hist_len.fill_(len(history))
        self.token.copy_(token.reshape(()))
        self.pos.fill_(self.state.next_position)
        self.kv_len.fill_(kv_len)
        self.draft_len.fill_(draft_len)
        self._start = (kv_len, self.state.seq_len)

    @torch.inference_mode()
    def launch(self, clock: Any = None) -> int:
        """Queue one step and the copy of its report to the host; returns the report's slot for ``result``."""
        marks = [clock.mark()] if clock is not None else []
        for i, part in enumerate((self._draft, self._verify, self._advance)):
            if self.graphs is not None:
                self.graphs[i].replay()
            else:
                part()
            if clock is not None:
                marks.append(clock.mark())
        if self.graphs is not None and self._replay_counts is not None:
            self.verify.executor.add_host_counts(self._replay_counts)
        if clock is not None:
            for name, a, b in zip(("draft", "verify", "rollback"), marks, marks[1:]):
                clock.add(name, a, b)
        slot = self._launched % self._slots.shape[0]
        self._launched += 1
        self._slots[slot].copy_(self.report, non_blocking=True)
        if self.report.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._events[slot] = event
        return slot

    def result(self, slot: int) -> list[int]:
        """The report of the step launched into ``slot``: ``[keep, choice...]`` (waits for it)."""
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        return self._slots[slot].tolist()

    @torch.inference_mode()
    def store(self) -> torch.Tensor:
        """After the last launched step: the counters into the state's and the draft cache's lengths (one sync);
        returns the next opening token (a device scalar)."""
        pos, kv_len, draft_len, _ = self._counters.tolist()
        kv0, seq0 = self._start
        for c in self.state.kv.values():
            c.length = kv_len
        self.state.seq_len = seq0 + kv_len - kv0
        self.state.next_position = pos
        self.cache.length = draft_len
        return self.token.clone()

    def _draft(self) -> None:
        d, v = self.draft, self.verify
        d._block[:1].copy_(self.token.view(1))
        d._run()  # its ids into the verify block's
        if self.lookup:
            d.drafted.copy_(merge_lookup(d.drafted, self.history, self.hist_len, self.lookup))
        torch.add(v._offsets, self.pos, out=v.positions)

    def _verify(self) -> None:
        self.verify._run()
        choice = self.report[1:]
        torch.argmax(self.verify.logits, -1, out=choice)  # [T]: the target's token after each prefix
        agree = (self.draft.drafted == choice[:-1]).long().cumprod(0).sum()
        torch.add(agree, 1, out=self.keep)

    def _advance(self) -> None:
        self.draft._run_extend()  # the block's rows at the draft cache's length; the kept ones are counted below
        self.verify.restore_at(self.keep)
        torch.gather(self.report[1:], 0, (self.keep - 1).view(1), out=self.token.view(1))
        if self.lookup:  # the block's choices at the history's end; the kept ones are counted below
            self.history.index_copy_(0, self._hist_offsets + self.hist_len, self.report[1:])
        self._counters.add_(self.keep)

    @torch.inference_mode()
    def _capture(self) -> tuple[tuple[torch.cuda.CUDAGraph, ...], list[int] | None]:
        """The three launches captured (one memory pool), with the state, the draft cache and the counters put
        back as they were: the warm-up runs write rows from the counters' start and move the counters."""
        state, cache, rows = self.state, self.cache, (room_steps(self.lag) + 1) * self.tokens
        saved = [(t, t.clone()) for t in (*state.conv.values(), *state.recurrent.values(), self.verify.ids,
                                          self._counters, self.report, self.history)]
        saved += [(t[:, :rows], t[:, :rows].clone()) for c in state.kv.values() for t in (c.k, c.v)]
        saved += [(t[:, :rows], t[:, :rows].clone()) for t in (*cache.k, *cache.v)]
        saved.append((cache.positions[:rows], cache.positions[:rows].clone()))
        dev = self.report.device
        pool = torch.cuda.graph_pool_handle()
        try:
            draft = capture_graph(self._draft, dev, pool)
            verify, counts = capture_counted(self._verify, dev, self.verify.executor, pool)
            advance = capture_graph(self._advance, dev, pool)
            return (draft, verify, advance), counts
        finally:
            for t, copy in saved:
                t.copy_(copy)
