"""Per-sequence model state: KV caches of the attention layers, conv and recurrent states of
the Gated DeltaNet layers, and the sequence length and next position.

KV caches can be cropped (speculative decoding rolls rejected tokens back that way); GDN
states cannot, so rollback of a whole state goes through ``clone`` / ``copy_from``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from engine.model.config import ModelConfig


@dataclass
class KVCache:
    """Keys and values of one attention layer, preallocated to ``max_len`` tokens."""

    k: torch.Tensor  # [n_head_kv, max_len, head_dim], RoPE already applied
    v: torch.Tensor  # [n_head_kv, max_len, head_dim]
    length: int = 0

    @classmethod
    def empty(cls, n_head_kv: int, max_len: int, head_dim: int, *, device: torch.device | str,
              dtype: torch.dtype) -> "KVCache":
        shape = (n_head_kv, max_len, head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` [n_head_kv, T, head_dim] after the cached tokens; return views of all of them."""
        end = self.length + k.shape[1]
        if end > self.max_len:
            raise ConfigError(f"KV cache holds at most {self.max_len} tokens; {end} were asked for "
                              f"(raise the state's max_len)")
        self.k[:, self.length:end] = k
        self.v[:, self.length:end] = v
        self.length = end
        return self.k[:, :end], self.v[:, :end]

    def crop(self, n: int) -> None:
        """Keep the first ``n`` cached tokens."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a KV cache of {self.length} tokens to {n}")
        self.length = n


@dataclass
class ModelState:
    """Everything a forward pass reads and advances for one sequence."""

    kv: dict[int, KVCache]  # attention layer -> cache
    conv: dict[int, torch.Tensor]  # GDN layer -> [conv_dim, conv_kernel - 1], last inputs of the conv
    recurrent: dict[int, torch.Tensor]  # GDN layer -> [v_heads, head_k, head_v] float32, HF value-head order
    seq_len: int = 0  # tokens consumed so far
    next_position: int = 0  # position id the next token gets when none is given

    @classmethod
    def new(cls, cfg: ModelConfig, max_len: int, *, device: torch.device | str, dtype: torch.dtype) -> "ModelState":
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        kv = {i: KVCache.empty(cfg.n_head_kv, max_len, cfg.head_dim, device=device, dtype=dtype)
              for i in cfg.attention_layers}
        conv = {i: torch.zeros(cfg.gdn_conv_dim, cfg.conv_kernel - 1, device=device, dtype=dtype)
                for i in cfg.gdn_layers}
        recurrent = {i: torch.zeros(cfg.gdn_v_heads, cfg.gdn_head_k, cfg.gdn_head_v, device=device,
                                    dtype=torch.float32)
                     for i in cfg.gdn_layers}
        return cls(kv, conv, recurrent)

    @property
    def max_len(self) -> int:
        return min((c.max_len for c in self.kv.values()), default=0)

    def clone(self) -> "ModelState":
        """A deep copy (tensors copied on their device)."""
        return ModelState(
            kv={i: KVCache(c.k.clone(), c.v.clone(), c.length) for i, c in self.kv.items()},
            conv={i: t.clone() for i, t in self.conv.items()},
            recurrent={i: t.clone() for i, t in self.recurrent.items()},
            seq_len=self.seq_len,
            next_position=self.next_position,
        )

    def reset(self) -> None:
        """Empty the state in place (buffers are kept: a captured decode step still reads them).

        KV caches only drop their length: entries past it are never attended to.
        """
        for c in self.kv.values():
            c.length = 0
        for t in (*self.conv.values(), *self.recurrent.values()):
            t.zero_()
        self.seq_len = 0
        self.next_position = 0

    def copy_from(self, other: "ModelState") -> None:
        """Overwrite this state with ``other`` in place (buffers are reused, no allocation)."""
        if self.kv.keys() != other.kv.keys() or self.conv.keys() != other.conv.keys():
            raise ValueError("cannot copy a model state of a different layer layout")
        for i, c in other.kv.items():
            mine = self.kv[i]
            if mine.max_len < c.length:
                raise ValueError(f"layer {i}: KV cache of {mine.max_len} tokens cannot hold {c.length}")
            mine.k[:, :c.length] = c.k[:, :c.length]
            mine.v[:, :c.length] = c.v[:, :c.length]
            mine.length = c.length
        for i, t in other.conv.items():
            self.conv[i].copy_(t)
        for i, t in other.recurrent.items():
            self.recurrent[i].copy_(t)
        self.seq_len = other.seq_len
        self.next_position = other.next_position
