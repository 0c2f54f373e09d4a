"""The PFlash drafter: a small qwen35moe, run by the engine's own model code, whose
attention layers say which prompt tokens matter.

The model's attention layers do not hand out their queries, so ``lookahead`` recomputes
them (``lookahead_queries``) from the residual stream captured at the layer's input,
exactly as ``engine.model.attention.attention_forward`` forms them; the keys are read from
the drafter's KV caches, where RoPE is already applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from engine.errors import IncompatibleModelError
from engine.gguf.reader import GGUFFile
from engine.model.attention import apply_rope, rope_cos_sin
from engine.model.config import ModelConfig
from engine.model.norm import rms_norm
from engine.model.qwen35moe import Qwen35MoE
from engine.model.weights import AttentionWeights, LayerWeights
from engine.tokenizer import Tokenizer

_TOKENS = "tokenizer.ggml.tokens"


def lookahead_queries(layer: LayerWeights, h_in: torch.Tensor, positions: torch.Tensor,
                      cfg: ModelConfig) -> torch.Tensor:
    """Queries [n_head, NL, head_dim] of attention layer ``layer`` for residual-stream inputs
    ``h_in`` [NL, hidden] at ``positions`` [NL]: attn_norm, attn_q (query half), q_norm, RoPE."""
    w = layer.mixer
    if not isinstance(w, AttentionWeights):
        raise ValueError("lookahead queries exist only for attention layers")
    n, d = h_in.shape[0], cfg.head_dim
    x = rms_norm(h_in, layer.attn_norm, cfg.rms_eps)
    q = F.linear(x, w.q).view(n, cfg.n_head, 2 * d)[..., :d]
    q = rms_norm(q, w.q_norm, cfg.rms_eps)
    cos, sin = rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta)
    return apply_rope(q, cos, sin).transpose(0, 1)


def check_same_vocabulary(drafter_tokens: Sequence[str], target_tokens: Sequence[str], source: str) -> None:
    """Refuse a drafter whose token ids mean other strings than the target's."""
    if len(drafter_tokens) != len(target_tokens):
        raise IncompatibleModelError(
            f"{source}: the drafter's vocabulary has {len(drafter_tokens)} tokens but the target's "
            f"has {len(target_tokens)}; PFlash needs the target's own tokenizer")
    diff = next((i for i, (a, b) in enumerate(zip(drafter_tokens, target_tokens)) if a != b), None)
    if diff is not None:
        raise IncompatibleModelError(
            f"{source}: token id {diff} is {drafter_tokens[diff]!r} in the drafter but "
            f"{target_tokens[diff]!r} in the target; PFlash needs the target's own tokenizer")


class Drafter:
    """A loaded drafter model; ``lookahead`` runs it over a prompt."""

    def __init__(self, model: Qwen35MoE, *, path: Path) -> None:
        if not model.cfg.attention_layers:
            raise IncompatibleModelError(f"{path}: the drafter has no attention layers to score tokens with")
        self.model = model
        self.path = path

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def device(self) -> torch.device:
        return self.model.device

    @classmethod
    def from_gguf(cls, path: str | Path, *, target_vocab: Tokenizer | Sequence[str],
                  device: torch.device | str, dtype: torch.dtype | None = None) -> "Drafter":
        """Load a qwen35moe drafter, refusing it unless its vocabulary is the target's.

        ``target_vocab`` is the target's tokenizer or its token strings (``tokenizer.ggml.tokens``).
        """
        path = Path(path)
        target_tokens = target_vocab.spec.tokens if isinstance(target_vocab, Tokenizer) else target_vocab
        with GGUFFile(path) as f:
            tokens = f.metadata.get(_TOKENS)
            if tokens is None:
                raise IncompatibleModelError(
                    f"{path}: {_TOKENS} is missing, so the drafter's vocabulary cannot be checked "
                    "against the target's")
            check_same_vocabulary(tokens, target_tokens, str(path))
            model = Qwen35MoE.from_gguf(f, device=device, dtype=dtype)
        return cls(model, path=path)

    @torch.inference_mode()
    def lookahead(self, ids: torch.Tensor, n_look: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Prefill the drafter over ``ids`` [T]; per attention layer, the queries of the last
        ``n_look`` tokens [n_head, n_look, head_dim] and all keys [n_head_kv, T, head_dim]
        (a view of the KV cache). Positions are 0..T-1."""
        cfg, model = self.cfg, self.model
        t = ids.shape[0]
        if not 0 < n_look <= t:
            raise ValueError(f"n_look must be in 1..{t}, got {n_look}")
        ids = ids.to(self.device)
        state = model.new_state(t)
        inputs = [i - 1 for i in cfg.attention_layers if i > 0]  # layer i's input is layer i-1's output
        if t > n_look:
            model.forward(ids[:-n_look], state, logits="none")
        tail = model.forward(ids[-n_look:], state, capture_layers=inputs, logits="none")
        positions = torch.arange(t - n_look, t, device=self.device)
        queries, keys = [], []
        for i in cfg.attention_layers:
            h_in = tail.hidden[i - 1] if i > 0 else F.embedding(ids[-n_look:], model.weights.embed)
            queries.append(lookahead_queries(model.weights.layers[i], h_in, positions, cfg))
            keys.append(state.kv[i].k[:, :t])
        return queries, keys
