"""Gated DeltaNet value-head order: HF/fla "grouped" versus GGUF "tiled".

With ``r = v_heads / k_heads`` value heads per key head, HF (and fla) store value head
``p`` as the one reading key head ``p // r``: ``[k0v0, k0v1, .., k1v0, k1v1, ..]``.
llama.cpp's converter (``_LinearAttentionVReorderBase._reorder_v_heads``) re-tiles them so
that ggml can broadcast q/k with a plain repeat: value head ``p`` reads key head
``p % k_heads``: ``[k0v0, k1v0, .., k0v1, k1v1, ..]``.

The converter applies ``to_tiled`` (HF -> GGUF); the loader applies ``to_grouped``
(GGUF -> engine order). Both act on tensors already in GGUF names and torch shapes.
"""

from __future__ import annotations

import torch

from engine.model.config import ModelConfig


def _swap_head_axes(x: torch.Tensor, dim: int, outer: int, inner: int, head_dim: int) -> torch.Tensor:
    """View ``dim`` as ``[outer, inner, head_dim]`` and return it laid out as ``[inner, outer, head_dim]``."""
    dim %= x.dim()
    shape = list(x.shape)
    if shape[dim] != outer * inner * head_dim:
        raise ValueError(f"dimension {dim} of size {shape[dim]} is not {outer} x {inner} x {head_dim}")
    split = x.reshape(*shape[:dim], outer, inner, head_dim, *shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(shape)


def to_tiled(x: torch.Tensor, dim: int, k_heads: int, v_heads: int, head_dim: int) -> torch.Tensor:
    """Grouped (HF) -> tiled (GGUF) order of the value heads along ``dim``."""
    return _swap_head_axes(x, dim, k_heads, v_heads // k_heads, head_dim)


def to_grouped(x: torch.Tensor, dim: int, k_heads: int, v_heads: int, head_dim: int) -> torch.Tensor:
    """Tiled (GGUF) -> grouped (HF) order of the value heads along ``dim``."""
    return _swap_head_axes(x, dim, v_heads // k_heads, k_heads, head_dim)


# GGUF tensor suffix -> (dim holding value heads, part of that dim holding them, per-head size)
# The "part" is "all" or "v": the V channels after the 2 * key_dim q/k channels.
_TOUCHED = {
    "attn_qkv.weight": (0, "v", "head_v"),
    "ssm_conv1d.weight": (0, "v", "head_v"),
    "attn_gate.weight": (0, "all", "head_v"),
    "ssm_alpha.weight": (0, "all", 1),
    "ssm_beta.weight": (0, "all", 1),
    "ssm_a": (0, "all", 1),
    "ssm_dt.bias": (0, "all", 1),
    "ssm_out.weight": (1, "all", "head_v"),
}


def is_value_head_tensor(name: str) -> bool:
    """True for the GDN tensors whose value heads GGUF stores tiled."""
    return any(name.endswith("." + suffix) for suffix in _TOUCHED)


def reorder_value_heads(name: str, x: torch.Tensor, cfg: ModelConfig, *, to: str) -> torch.Tensor:
    """Reorder the value heads of GDN tensor ``name`` (GGUF name, torch shape) ``to`` "tiled" or "grouped".

    Tensors that hold no value heads are returned unchanged; so is everything when key and
    value head counts are equal (llama.cpp skips the re-tiling then, and it is the identity).
    """
    if to not in ("tiled", "grouped"):
        raise ValueError(f"value-head order must be 'tiled' or 'grouped', got {to!r}")
    suffix = next((s for s in _TOUCHED if name.endswith("." + s)), None)
    if suffix is None or cfg.gdn_k_heads == cfg.gdn_v_heads:
        return x
    dim, part, size = _TOUCHED[suffix]
    head_dim = cfg.gdn_head_v if size == "head_v" else size
    reorder = to_tiled if to == "tiled" else to_grouped

    def apply(t: torch.Tensor) -> torch.Tensor:
        return reorder(t, dim, cfg.gdn_k_heads, cfg.gdn_v_heads, head_dim)

    if part == "all":
        return apply(x)
    qk = 2 * cfg.gdn_key_dim
    return torch.cat([x.narrow(dim, 0, qk), apply(x.narrow(dim, qk, x.shape[dim] - qk))], dim=dim)
