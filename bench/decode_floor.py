"""The memory-bandwidth floor of decoding: weight bytes one token reads, and the device's
copy bandwidth.

Bytes per token count what a decode step must stream from memory whatever the engine: every
non-expert tensor of the blocks that run, one row of the token embedding (a lookup, not a
product), and per layer the ``expert_used_count`` routed experts' slices of the expert
tensors, all at their sizes in the GGUF file. KV-cache and recurrent-state traffic are left
out, so at large depths the floor is optimistic.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.gguf.names import is_expert_tensor
from engine.gguf.reader import GGUFFile
from engine.model.config import ModelConfig

_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class ActiveBytes:
    """Bytes one decoded token reads, split by kind; ``expert_layer_bytes`` holds all routed
    experts' bytes of each layer (what llama.cpp's -ncmoe moves off the GPU per layer)."""

    non_expert: int
    embedding_row: int
    experts_active: int
    expert_layer_bytes: tuple[int, ...]
    n_expert: int
    n_expert_used: int

    @property
    def per_token(self) -> int:
        return self.non_expert + self.embedding_row + self.experts_active

    def floor_tok_s(self, bandwidth_bytes_s: float) -> float:
        return bandwidth_bytes_s / self.per_token


def active_bytes(path: str | Path) -> ActiveBytes:
    """Weight bytes per decoded token of a qwen35moe GGUF, from its tensor index alone."""
    with GGUFFile(path) as f:
        cfg = ModelConfig.from_metadata(f.metadata, source=str(path))
        non_expert = embedding_row = 0
        layer_bytes = [0] * cfg.n_layers
        for name, info in f.tensors.items():
            block = _BLOCK.match(name)
            if block and int(block.group(1)) >= cfg.n_layers:
                continue  # an MTP block: loaded, never run while decoding
            if is_expert_tensor(name):
                if info.shape[0] != cfg.n_expert:
                    raise ValueError(f"{path}: {name} has {info.shape[0]} experts, the metadata says {cfg.n_expert}")
                layer_bytes[int(block.group(1))] += info.nbytes
            elif name == "token_embd.weight":
                embedding_row = info.nbytes // info.shape[0]
            else:
                non_expert += info.nbytes
    if not all(layer_bytes):
        missing = [layer for layer, b in enumerate(layer_bytes) if b == 0]
        raise ValueError(f"{path}: layers {missing} have no routed expert tensors")
    active = sum(b * cfg.n_expert_used // cfg.n_expert for b in layer_bytes)
    return ActiveBytes(non_expert=non_expert, embedding_row=embedding_row, experts_active=active,
                       expert_layer_bytes=tuple(layer_bytes), n_expert=cfg.n_expert,
                       n_expert_used=cfg.n_expert_used)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second moved by a large same-device copy (each copy reads and writes ``nbytes``),
    the best of ``repeats`` after one warm-up."""
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes and repeats must be positive, got {nbytes} and {repeats}")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * nbytes / best
