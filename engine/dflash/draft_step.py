"""The draft's proposal for one verify block, with fixed shapes, replayable from a CUDA graph.

``block_hidden`` reads the draft cache up to its current length, a shape that grows every step,
so each proposal is a fresh series of launches. ``DraftStep`` instead attends over the cache's
whole preallocated buffers under a mask built on the device from the cache length, takes the
opening token and the block's start position from device buffers too, and writes the drafted
ids into a buffer: the same kernels on the same addresses every time, so it is captured once
and replayed. Masked keys add nothing after the softmax, so the proposals are the eager ones.

A full-attention, non-causal draft (every published one) runs ``DFlashDraft.forward_in_cache``:
the block's own keys and values go into the cache rows just past the context (the rows the
next extension overwrites), so each layer attends over one buffer with one mask and the engine's
fused kernels, with no copy of the cache (on the H200 the shipped draft's proposal span fell from
0.5-0.7 to 0.26-0.31 ms at spec_len 4). Other drafts, and a block that would not fit the cache,
take the general path.

With ``context`` (the verify step's captured hidden buffers), the cache's extension after a
verify block is a fixed-shape step of its own: the context rows of all of the block's tokens
are projected and written at device-side slots from the cache length, and the host then counts
only the kept ones in (``extend``); rows past them are masked out and overwritten by the next
extension. One replay instead of some twenty launches from Python after every verify.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.dflash.draft import DFlashDraft, DraftCache, FusedDraftWeights, in_cache_blocker
from engine.model.decode_graph import capture_graph
from engine.model.linear import Weight, linear


class DraftStep:
    """Proposals of ``tokens - 1`` ids after an opening token, over ``cache``'s buffers.

    ``graph``: capture (the draft on a CUDA device) or run the same fixed-shape step eagerly.
    """

    def __init__(self, draft: DFlashDraft, cache: DraftCache, embed: torch.Tensor, output: Weight, *,
                 tokens: int, graph: bool, context: dict[int, torch.Tensor] | None = None) -> None:
        if not 2 <= tokens <= draft.cfg.block_size:
            raise ValueError(f"a draft step proposes a block of 2 to {draft.cfg.block_size} tokens, got {tokens}")
        if graph and draft.device.type != "cuda":
            raise ValueError(f"a draft step is captured on CUDA only, the draft is on {draft.device}")
        self.draft, self.cache, self.embed, self.output = draft, cache, embed, output
        self.tokens = tokens
        dev = draft.device
        with torch.inference_mode():
            self.start = torch.zeros((), dtype=torch.long, device=dev)
            self.length = torch.zeros((), dtype=torch.long, device=dev)
            self.drafted = torch.zeros(tokens - 1, dtype=torch.long, device=dev)
            self._offsets = torch.arange(tokens, device=dev)
            self._slots = torch.arange(cache.max_len, device=dev)
            self._block_sees_block = torch.ones(tokens, tokens, dtype=torch.bool, device=dev)
            self._context_start = torch.zeros((), dtype=torch.long, device=dev)
            self._block = torch.full((tokens,), draft.cfg.mask_token_id, dtype=torch.long, device=dev)  # [token, masks]
        self.in_cache = in_cache_blocker(draft.cfg) is None
        self._fused = FusedDraftWeights.of(draft) if self.in_cache else None
        if context is not None:
            missing = set(draft.cfg.target_layer_ids) - set(context)
            if missing or any(context[i].shape[0] != tokens for i in draft.cfg.target_layer_ids):
                raise ValueError(f"the context buffers must hold {tokens} rows of target layers "
                                 f"{list(draft.cfg.target_layer_ids)}")
        self.context = context
        self.graph: torch.cuda.CUDAGraph | None = self._capture(self._run) if graph else None
        self.extend_graph: torch.cuda.CUDAGraph | None = None
        if graph and context is not None:  # written rows are overwritten by the prefill's extension
            self.extend_graph = self._capture(self._run_extend)

    @property
    def path(self) -> str:
        return "cuda_graph" if self.graph is not None else "static"

    @torch.inference_mode()
    def step(self, token: torch.Tensor, start: int) -> torch.Tensor:
        """Draft after ``token`` (one id, on the device) at position ``start``: the buffer of
        ``tokens - 1`` proposed ids, overwritten by the next step."""
        self._block[:1].copy_(token.reshape(1))
        self.start.fill_(start)
        self.length.fill_(self.cache.length)
        if self.in_cache and self.cache.length + self.tokens > self.cache.max_len:
            self._run_masked()  # the block's rows would pass the cache's end
        elif self.graph is not None:
            self.graph.replay()
        else:
            self._run()
        return self.drafted

    def _run(self) -> None:
        if not self.in_cache:
            self._run_masked()
            return
        offsets = self._offsets
        slots = self.length + offsets
        visible = (self._slots < self.length + self.tokens).expand(self.tokens, -1)  # the context and the block
        hidden = self.draft.forward_in_cache(F.embedding(self._block, self.embed), self.start + offsets, self.cache,
                                             slots, visible, self._fused)
        torch.argmax(linear(hidden[1:], self.output), -1, out=self.drafted)

    def _run_masked(self) -> None:
        n = self.tokens
        x = F.embedding(self._block, self.embed)
        positions = self.start + self._offsets
        in_cache = (self._slots < self.length).expand(n, -1)  # [n, max_len]
        visible = torch.cat([in_cache, self._block_sees_block], dim=1)
        context = list(zip(self.cache.k, self.cache.v))
        hidden = self.draft(x, positions, context, self.cache.positions, visible)
        self.drafted.copy_(linear(hidden[1:], self.output).argmax(-1))

    @torch.inference_mode()
    def extend(self, start: int, keep: int) -> bool:
        """Count the first ``keep`` rows of ``context`` (the verify block that began at position
        ``start``) into the cache: ``write_block`` then ``count``. False, with the cache untouched,
        where the step has no ``context`` or the whole block's rows would not fit: then extend the
        cache eagerly."""
        if not self.write_block(start):
            return False
        self.count(keep)
        return True

    @torch.inference_mode()
    def write_block(self, start: int) -> bool:
        """Write every row of ``context`` (the verify block that began at position ``start``) at the
        cache's slots from its length, without counting any in. It needs neither the acceptance nor
        a host sync, so the speculative loop launches it before it waits for the acceptance. False,
        writing nothing, where the step has no ``context`` or the block's rows would not fit."""
        if self.context is None or self.cache.length + self.tokens > self.cache.max_len:
            return False
        self.length.fill_(self.cache.length)
        self._context_start.fill_(start)
        if self.extend_graph is not None:
            self.extend_graph.replay()
        else:
            self._run_extend()
        return True

    def count(self, keep: int) -> None:
        """Count the first ``keep`` rows that ``write_block`` wrote into the cache; the rows past them
        are masked out and overwritten by the next block."""
        if not 1 <= keep <= self.tokens:
            raise ValueError(f"keep must be 1..{self.tokens}, got {keep}")
        self.cache.length += keep

    def _run_extend(self) -> None:
        features = torch.cat([self.context[i] for i in self.draft.cfg.target_layer_ids], dim=-1)
        positions = self._context_start + self._offsets
        slots = self.length + self._offsets
        if self._fused is not None:  # merged k/v products, norm + RoPE + cache writes in one launch a layer
            self.draft.write_context(features, positions, self.cache, slots, self._fused)
            return
        for i, (k, v) in enumerate(self.draft.project_context(features, positions)):
            self.cache.k[i].index_copy_(1, slots, k)
            self.cache.v[i].index_copy_(1, slots, v)
        self.cache.positions.index_copy_(0, slots, positions)

    @torch.inference_mode()
    def _capture(self, run) -> torch.cuda.CUDAGraph:
        return capture_graph(run, self.draft.device)
