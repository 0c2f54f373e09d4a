"""The draft's proposal for one verify block, with fixed shapes, replayable from a CUDA graph.

``block_hidden`` reads the draft cache up to its current length, a shape that grows every step,
so each proposal is a fresh series of launches. ``DraftStep`` instead attends over the cache's
whole preallocated buffers under a mask built on the device from the cache length, takes the
opening token and the block's start position from device buffers too, and writes the drafted
ids into a buffer: the same kernels on the same addresses every time, so it is captured once
and replayed. Masked keys add nothing after the softmax, so the proposals are the eager ones.
The cache itself is still extended eagerly (``DraftCache.extend``, a few rows per step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.dflash.draft import DFlashDraft, DraftCache
from engine.model.decode_graph import capture_graph
from engine.model.linear import Weight, linear


class DraftStep:
    """Proposals of ``tokens - 1`` ids after an opening token, over ``cache``'s buffers.

    ``graph``: capture (the draft on a CUDA device) or run the same fixed-shape step eagerly.
    """

    def __init__(self, draft: DFlashDraft, cache: DraftCache, embed: torch.Tensor, output: Weight, *,
                 tokens: int, graph: bool) -> None:
        if not 2 <= tokens <= draft.cfg.block_size:
            raise ValueError(f"a draft step proposes a block of 2 to {draft.cfg.block_size} tokens, got {tokens}")
        if graph and draft.device.type != "cuda":
            raise ValueError(f"a draft step is captured on CUDA only, the draft is on {draft.device}")
        self.draft, self.cache, self.embed, self.output = draft, cache, embed, output
        self.tokens = tokens
        dev = draft.device
        with torch.inference_mode():
            self.token = torch.zeros(1, dtype=torch.long, device=dev)
            self.start = torch.zeros((), dtype=torch.long, device=dev)
            self.length = torch.zeros((), dtype=torch.long, device=dev)
            self.drafted = torch.zeros(tokens - 1, dtype=torch.long, device=dev)
            self._masks = torch.full((tokens - 1,), draft.cfg.mask_token_id, dtype=torch.long, device=dev)
            self._offsets = torch.arange(tokens, device=dev)
            self._slots = torch.arange(cache.max_len, device=dev)
            self._block_sees_block = torch.ones(tokens, tokens, dtype=torch.bool, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = self._capture() if graph else None

    @property
    def path(self) -> str:
        return "cuda_graph" if self.graph is not None else "static"

    @torch.inference_mode()
    def step(self, token: torch.Tensor, start: int) -> torch.Tensor:
        """Draft after ``token`` (one id, on the device) at position ``start``: the buffer of
        ``tokens - 1`` proposed ids, overwritten by the next step."""
        self.token.copy_(token.reshape(1))
        self.start.fill_(start)
        self.length.fill_(self.cache.length)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()
        return self.drafted

    def _run(self) -> None:
        n = self.tokens
        x = F.embedding(torch.cat([self.token, self._masks]), self.embed)
        positions = self.start + self._offsets
        in_cache = (self._slots < self.length).expand(n, -1)  # [n, max_len]
        visible = torch.cat([in_cache, self._block_sees_block], dim=1)
        context = list(zip(self.cache.k, self.cache.v))
        hidden = self.draft(x, positions, context, self.cache.positions, visible)
        self.drafted.copy_(linear(hidden[1:], self.output).argmax(-1))

    @torch.inference_mode()
    def _capture(self) -> torch.cuda.CUDAGraph:
        return capture_graph(self._run, self.draft.device)
