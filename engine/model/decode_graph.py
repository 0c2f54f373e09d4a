"""A decode step of fixed shapes, captured in a CUDA graph and replayed once per token.

``Qwen35MoE.forward`` sizes its work from Python ints (the KV cache length, the positions)
and its default expert executor reads the routing back to the host in every layer, so each
token costs thousands of launches driven from Python. The static step here runs ``T``
tokens (1 for plain decoding, a verify block for speculative decoding) with everything that
changes between steps in preallocated device buffers: token ids, positions and the KV
caches' length. Keys and values are written at device-side indices, attention runs over the
whole preallocated cache under a mask built from that length, the Gated DeltaNet layers use
the Triton decode kernel and the routed experts the fused-MoE kernels. The step launches the
same kernels on the same addresses every time, so it is captured once, after a warm-up that
compiles the Triton kernels, and replayed with one launch.

``DecodeGraph`` keeps the state's Python-side lengths and next position in step with what the
device did, so eager ``forward`` calls continue from the same state. Where the step cannot
be captured, ``graph_blocker`` says why (a hybrid placement with cold experts on the CPU
needs the host; so does a routing observer, or any executor not marked ``graph_safe``) and
the same object runs the static step eagerly.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Callable, Collection

import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.model.attention import attention_static, rope_cos_sin
from engine.model.gated_deltanet import GDNRecord, decode_delta_rule, replay_prefix
from engine.model.linear import linear
from engine.model.moe import ExpertExecutor, FusedExpertExecutor, TorchExpertExecutor
from engine.model.qwen35moe import Qwen35MoE
from engine.model.state import ModelState
from engine.model.weights import AttentionWeights

MAX_TOKENS = 16  # the Triton GDN decode kernel's limit; verify blocks are shorter
KERNELS = ("auto", "triton", "torch")
WARMUP_RUNS = 2  # the first compiles the Triton kernels, the second runs as the graph will
# How a rollback step brings the Gated DeltaNet states back to a kept prefix: "states" stores the
# state after every token of the step (the delta rule's launch writes them) and copies the kept
# one; "replay" runs the delta rule again over the kept tokens from the states before the step.
# "auto": "states" while its buffer ([GDN layers, T, v_heads, head_k, head_v] float32) takes at
# most TOKEN_STATES_MAX_BYTES (6.5 MB for the shipped target at 17 tokens; the 35B's 30 layers
# need 60 MB a token, where the writes would cost more than the replay saves).
RESTORES = ("auto", "states", "replay")
TOKEN_STATES_MAX_BYTES = 64 << 20


def resolve_kernels(kernels: str, device: torch.device) -> str:
    """``auto`` means the Triton kernels on CUDA when Triton is installed, torch otherwise."""
    if kernels not in KERNELS:
        raise ValueError(f"decode kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "auto":
        return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
    return kernels


def static_executor(model: Qwen35MoE, kernels: str) -> ExpertExecutor:
    """The expert executor the static step runs: the model's default one becomes the fused-MoE
    executor over the same weights when the Triton kernels are in use; others are kept."""
    executor = model.executor
    if isinstance(executor, TorchExpertExecutor) and kernels == "triton":
        return FusedExpertExecutor(executor.experts, impl="triton", device=model.device)
    return executor


def graph_blocker(model: Qwen35MoE, kernels: str = "auto") -> str | None:
    """Why the model's decode step cannot be captured in a CUDA graph, or None when it can."""
    if model.device.type != "cuda":
        return f"the model is on {model.device.type}, not on a CUDA device"
    if model.routing_observer is not None:
        return "a routing observer is attached (it runs Python inside every layer)"
    executor = static_executor(model, resolve_kernels(kernels, model.device))
    if not getattr(executor, "graph_safe", False):
        return (f"the expert executor {type(executor).__name__} needs the host on every layer "
                "(cold experts on CPU threads, or a torch kernel path)")
    return None


class DecodeGraph:
    """The static decode step of ``model`` over ``state``, captured when the configuration allows.

    The graph is bound to ``state``'s buffers: keep using this state (``ModelState.reset`` and
    ``copy_from`` work in place), not a clone. ``graph``: None captures where
    ``graph_blocker`` allows, True insists (``ConfigError`` otherwise), False never captures.
    ``kernels`` picks the Triton or torch implementations (``resolve_kernels``); on the CPU
    ``triton`` needs TRITON_INTERPRET=1. ``rollback`` makes every step keep what
    ``rollback(keep)`` needs (a DFlash verify step: each Gated DeltaNet layer's conv window and, as
    ``restore`` picks (``RESTORES``), its state after every token, or the states it started from and the
    delta rule's inputs). The warm-up before a capture runs the step twice (the state is restored
    afterwards; an executor's hit counters see those runs).
    """

    def __init__(self, model: Qwen35MoE, state: ModelState, *, tokens: int = 1,
                 capture_layers: Collection[int] = (), kernels: str = "auto", graph: bool | None = None,
                 rollback: bool = False, restore: str = "auto"):
        cfg = model.cfg
        if restore not in RESTORES:
            raise ValueError(f"restore must be one of {RESTORES}, got {restore!r}")
        if not 1 <= tokens <= MAX_TOKENS:
            raise ValueError(f"a static decode step takes 1 to {MAX_TOKENS} tokens, got {tokens}")
        if state.kv and tokens > state.max_len:
            raise ValueError(f"{tokens} tokens per step do not fit the state's KV caches of {state.max_len}")
        bad = sorted(i for i in capture_layers if not 0 <= i < cfg.n_layers)
        if bad:
            raise ValueError(f"capture_layers {bad} outside 0..{cfg.n_layers - 1}")
        self.model = model
        self.state = state
        self.tokens = tokens
        self.kernels = resolve_kernels(kernels, model.device)
        self.executor = static_executor(model, self.kernels)
        self.delta_rule, self.gdn_backend = decode_delta_rule(cfg.gdn_head_k, cfg.gdn_head_v, impl=self.kernels)
        # the rollback's replay of the kept tokens: the step's own kernel, leaving its start states as they are
        self._replay_rule, _ = decode_delta_rule(cfg.gdn_head_k, cfg.gdn_head_v, impl=self.kernels, in_place=False)
        self.blocker = graph_blocker(model, self.kernels)
        if graph and self.blocker is not None:
            raise ConfigError(f"the decode step cannot be captured in a CUDA graph: {self.blocker}")
        # what the capture read: a later swap of the executor or of its device slots invalidates it
        self._source = (model.executor, placement_version(model.executor))

        dev = model.device
        with torch.inference_mode():
            self.ids = torch.zeros(tokens, dtype=torch.long, device=dev)
            self.positions = torch.zeros(tokens, dtype=torch.long, device=dev)
            self.cache_len = torch.zeros((), dtype=torch.long, device=dev)
            self.logits = torch.zeros(tokens, cfg.vocab, dtype=torch.float32, device=dev)
            self.hidden = {i: torch.zeros(tokens, cfg.hidden, dtype=model.dtype, device=dev)
                           for i in sorted(capture_layers)}
            self._offsets = torch.arange(tokens, device=dev)
            self._tail = torch.arange(cfg.conv_kernel - 1, device=dev)
            self._keys = torch.arange(state.max_len, device=dev)
            self.records: dict[int, GDNRecord] | None = None
            self._windows: torch.Tensor | None = None  # [n_gdn, conv_dim, kernel - 1 + T]: the records' conv windows
            self._start: torch.Tensor | None = None  # [n_gdn, v_heads, head_k, head_v]: states before the step
            self._states: torch.Tensor | None = None  # [n_gdn, T, v_heads, head_k, head_v]: after each token
            self.restore: str | None = None  # "states" or "replay" in a rollback step with GDN layers
            if rollback and state.recurrent:
                n_gdn, shape = len(state.recurrent), next(iter(state.recurrent.values())).shape
                per_token = n_gdn * tokens * shape.numel() * 4
                self.restore = restore if restore != "auto" else (
                    "states" if per_token <= TOKEN_STATES_MAX_BYTES else "replay")
                # the conv windows side by side: a restore selects every layer's in one launch; the states too
                self._windows = torch.zeros(n_gdn, cfg.gdn_conv_dim, cfg.conv_kernel - 1 + tokens,
                                            device=dev, dtype=model.dtype)
                if self.restore == "states":
                    self._states = torch.zeros(n_gdn, tokens, *shape, device=dev, dtype=torch.float32)
                self.records = {i: GDNRecord.empty(cfg, tokens, device=dev, dtype=model.dtype, window=self._windows[j],
                                                   states=None if self._states is None else self._states[j])
                                for j, i in enumerate(state.recurrent)}
                if self._states is None:
                    self._start = torch.stack([state.recurrent[i] for i in self.records])
        self.graph: torch.cuda.CUDAGraph | None = None
        self._replay_counts: list[int] | None = None  # the executor's host counts one replay adds
        if graph is not False and self.blocker is None:
            self.graph, self._replay_counts = self._capture()
        self._rollbacks: dict[int, torch.cuda.CUDAGraph] = {}  # keep -> the captured state restore
        self._rollback_eager = False  # set when a restore could not be captured: every restore then runs eagerly

    @property
    def captured(self) -> bool:
        return self.graph is not None

    @property
    def path(self) -> str:
        """``cuda_graph`` when steps replay the captured graph, ``static`` when they run eagerly."""
        return "cuda_graph" if self.captured else "static"

    def current(self) -> bool:
        """False once the model's expert executor or its placement changed since construction."""
        executor, version = self._source
        model = self.model
        return (model.executor is executor and placement_version(executor) == version
                and (not self.captured or model.routing_observer is None))

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` [T] at the state's next positions and advance the state.

        Returns the logits buffer [T, vocab] float32, overwritten by the next step; the
        residual streams of ``capture_layers`` are in ``hidden`` likewise.
        """
        T = self.tokens
        if ids.shape != (T,):
            raise ValueError(f"ids must have shape ({T},), got {tuple(ids.shape)}")
        state = self.state
        length = self._cache_length()
        if state.kv and length + T > state.max_len:
            raise ConfigError(f"{T} more tokens do not fit the state's KV caches of {state.max_len} tokens "
                              f"({length} held)")
        self.ids.copy_(ids)
        torch.add(self._offsets, state.next_position, out=self.positions)
        self.cache_len.fill_(length)
        if self.graph is not None:
            self.graph.replay()
            if self._replay_counts is not None:
                self.executor.add_host_counts(self._replay_counts)
        else:
            self._run()
        for c in state.kv.values():
            c.length += T
        state.seq_len += T
        state.next_position += T
        return self.logits

    @torch.inference_mode()
    def rollback(self, keep: int) -> None:
        """After a ``step`` of T tokens, leave the state as if only its first ``keep`` had run:
        KV caches cropped, each GDN layer's conv state taken from its window and its recurrent
        state copied from the step's per-token states (``restore`` "states") or rebuilt by one
        delta-rule call over the kept tokens of every layer at once ("replay").

        With the step captured, the restore for each ``keep`` is captured too, the first time
        that ``keep`` occurs, and replayed after: one launch instead of some twenty from Python
        at every partial acceptance."""
        T = self.tokens
        if not 1 <= keep <= T:
            raise ValueError(f"keep must be 1..{T}, got {keep}")
        if self.records is None and self.state.recurrent:
            raise ValueError("this decode step was built without rollback=True")
        if keep == T:
            return
        state, drop = self.state, T - keep
        for c in state.kv.values():
            c.crop(c.length - drop)
        state.seq_len -= drop
        state.next_position -= drop
        if not self.records:
            return
        if self.graph is None or self._rollback_eager:
            self._restore(keep)
            return
        if keep not in self._rollbacks and not self._capture_restore(keep):  # its warm-up runs restore already
            self._restore(keep)
            return
        self._rollbacks[keep].replay()

    @torch.inference_mode()
    def capture_rollbacks(self) -> None:
        """Capture the state restore of every kept length now (a verify loop's set-up), rather than
        at each one's first use inside the loop. The state is left as it was: the captures' warm-up
        runs write the recurrent and conv states, which are put back."""
        if self.graph is None or self._rollback_eager or not self.records:
            return
        saved = [(t, t.clone()) for t in (*self.state.conv.values(), *self.state.recurrent.values())]
        try:
            for keep in range(1, self.tokens):
                if keep not in self._rollbacks and not self._capture_restore(keep):
                    break
        finally:
            for t, copy in saved:
                t.copy_(copy)

    def _capture_restore(self, keep: int) -> bool:
        """Capture the restore of ``keep``; False, with one warning, where an op cannot be captured
        (every restore of this step then runs eagerly)."""
        try:
            self._rollbacks[keep] = capture_graph(lambda: self._restore(keep), self.model.device)
            return True
        except RuntimeError as exc:
            warnings.warn(f"the rollback's state restore could not be captured ({exc}); it runs eagerly",
                          stacklevel=3)
            self._rollback_eager = True
            return False

    @torch.inference_mode()
    def restore_at(self, keep: torch.Tensor) -> None:
        """``rollback``'s restore of the Gated DeltaNet states with ``keep`` a device scalar (1..T), so that it
        needs no host value and can be captured once for every ``keep``: the per-token state at ``keep`` is
        selected ("states"), or every token of the step is replayed, those from ``keep`` on with g = beta = 0
        (exp(0) = 1 and a zero correction leave the state exactly as it was; "replay"); each conv window is taken
        from ``keep`` on. The KV caches and the state's lengths are the caller's: attention reads the caches up
        to a length it keeps on the device."""
        if self.records is None and self.state.recurrent:
            raise ValueError("this decode step was built without rollback=True")
        if not self.records:
            return
        conv = self._windows.index_select(2, keep + self._tail)
        if self._states is not None:
            self._put_states(self._states.index_select(1, (keep - 1).view(1)).squeeze(1), conv)
            return
        live = (self._offsets < keep).float()[:, None]  # [T, 1]
        inputs = [(r.q, r.k, r.v, r.g, r.beta) for r in self.records.values()]
        s = replay_prefix(self._replay_rule, self._start, inputs, self.tokens, self.model.cfg.gdn_head_k ** -0.5,
                          live=live)
        self._put_states(s, conv)

    def _restore(self, keep: int) -> None:
        """The GDN layers' states after the first ``keep`` tokens of the last step, from what the
        step recorded; reads only the records (and the start states), so running it twice is harmless."""
        cfg = self.model.cfg
        if self._states is not None:
            s = self._states[:, keep - 1]
        else:
            inputs = [(r.q, r.k, r.v, r.g, r.beta) for r in self.records.values()]
            s = replay_prefix(self._replay_rule, self._start, inputs, keep, cfg.gdn_head_k ** -0.5)
        self._put_states(s, self._windows[:, :, keep:keep + cfg.conv_kernel - 1])

    def _put_states(self, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        """The GDN layers' recurrent [n_gdn, ...] and conv [n_gdn, conv_dim, kernel - 1] states into the state's
        tensors, each kind in one multi-tensor launch rather than one copy per layer."""
        state = self.state
        torch._foreach_copy_([state.recurrent[i] for i in self.records], list(recurrent.unbind(0)))
        torch._foreach_copy_([state.conv[i] for i in self.records], list(conv.unbind(0)))

    def _cache_length(self) -> int:
        lengths = {c.length for c in self.state.kv.values()}
        if len(lengths) > 1:
            raise ValueError(f"the state's KV caches hold different lengths {sorted(lengths)}")
        return lengths.pop() if lengths else 0

    def _run(self) -> None:
        """The step itself: reads only the device buffers, writes the state, logits and hidden."""
        model, state = self.model, self.state
        slots = self.cache_len + self._offsets  # [T] cache index of each token
        visible = self._keys[None, :] <= slots[:, None]  # [T, max_len]: causal inside the block

        cfg = model.cfg
        rope = rope_cos_sin(self.positions, cfg.rope_dim, cfg.rope_theta) if state.kv else None

        def attend(i: int, mixer: AttentionWeights, x: torch.Tensor) -> torch.Tensor:
            return attention_static(mixer, x, self.positions, slots, visible, state.kv[i], cfg, rope, self.kernels)

        if self._start is not None:
            torch.stack([state.recurrent[i] for i in self.records], out=self._start)
        h = F.embedding(self.ids, model.weights.embed)
        observer = None if self.graph is not None else model.routing_observer
        final, hidden = model.run_layers(h, state, attend, delta_rule=self.delta_rule, executor=self.executor,
                                         observer=observer, capture=self.hidden.keys(), record=self.records)
        self.logits.copy_(linear(final, model.weights.output))
        for i, out in hidden.items():
            self.hidden[i].copy_(out)

    @torch.inference_mode()
    def _capture(self) -> tuple[torch.cuda.CUDAGraph, list[int] | None]:
        state, T = self.state, self.tokens
        saved_kv = {i: (c.k[:, :T].clone(), c.v[:, :T].clone()) for i, c in state.kv.items()}
        saved = [(t, t.clone()) for t in (*state.conv.values(), *state.recurrent.values())]
        self.ids.zero_()
        self.positions.copy_(self._offsets)
        self.cache_len.zero_()
        try:
            return capture_counted(self._run, self.model.device, self.executor)
        finally:  # the state as it was, whether the capture worked or raised
            for i, (k, v) in saved_kv.items():
                state.kv[i].k[:, :T] = k
                state.kv[i].v[:, :T] = v
            for t, copy in saved:
                t.copy_(copy)


def capture_graph(run: Callable[[], None], device: torch.device, pool=None) -> torch.cuda.CUDAGraph:
    """``run`` captured in a CUDA graph, after ``WARMUP_RUNS`` runs on a side stream (the first
    compiles the Triton kernels, the next runs as the graph will); ``pool``: a memory pool shared
    with other graphs (``torch.cuda.graph_pool_handle``) that never replay at once."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph


def capture_counted(run: Callable[[], None], device: torch.device, executor, pool=None
                    ) -> tuple[torch.cuda.CUDAGraph, list[int] | None]:
    """``capture_graph`` for a step whose expert executor keeps counts on the host (``host_counts``,
    as ``HybridExperts`` counts its pairs): also returns what one run counted, for each replay to add
    (``add_host_counts``), or None where the executor keeps none. The capture's own run is taken
    back off (its Python ran, its kernels did not); the warm-up runs count."""
    counts = getattr(executor, "host_counts", None)
    if counts is None:
        return capture_graph(run, device, pool), None
    per_run: list[int] = []

    def counted() -> None:
        before = counts()
        run()
        per_run[:] = [a - b for a, b in zip(counts(), before)]

    graph = capture_graph(counted, device, pool)
    executor.add_host_counts([-d for d in per_run])
    return graph, per_run if any(per_run) else None


def placement_version(executor: ExpertExecutor) -> int:
    return getattr(executor, "placement_version", 0)
