"""Shapes of the shipped qwen35moe family (target, PFlash drafter) and their HF configs.

A shape fixes everything but the vocabulary, which comes from the project's tokenizer. Sizes
are estimated from the tensor list the engine expects, so the shipped-file budget can be
checked before any training.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.gguf.names import expected_tensors
from engine.model.config import ModelConfig

@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layers: int
    hidden: int
    n_head: int
    n_head_kv: int
    head_dim: int
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_head_dim: int
    n_expert: int
    n_expert_used: int
    expert_ffn: int
    shared_ffn: int
    full_attention_interval: int = 4
    conv_kernel: int = 4
    rope_theta: float = 1e7
    partial_rotary: float = 0.25
    rms_eps: float = 1e-6
    context_length: int = 32768

    def __post_init__(self) -> None:
        if self.n_layers < self.full_attention_interval:
            raise ValueError(f"{self.name}: {self.n_layers} layers hold no attention layer at "
                             f"full_attention_interval {self.full_attention_interval}")
        if self.gdn_v_heads == self.gdn_k_heads:
            raise ValueError(f"{self.name}: GDN value heads must differ from key heads "
                             f"({self.gdn_v_heads}) to exercise the value-head order")
        if self.n_expert < 2 * self.n_expert_used:
            raise ValueError(f"{self.name}: {self.n_expert} experts are too few for top-{self.n_expert_used} routing")
        rotary = self.head_dim * self.partial_rotary
        if rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(f"{self.name}: partial_rotary {self.partial_rotary} of head_dim {self.head_dim} "
                             f"gives {rotary} rotated dims, expected an even integer")
        self.model_config(vocab=2)  # the engine's own checks (head multiples, expert counts)

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)

    @property
    def rope_sections(self) -> tuple[int, int, int]:
        """MRoPE sections over the rotated frequency pairs (text-only: all three see one position)."""
        pairs = self.rope_dim // 2
        first = -(-pairs // 3)
        second = -(-(pairs - first) // 2)
        return first, second, pairs - first - second

    def model_config(self, vocab: int) -> ModelConfig:
        return ModelConfig(
            n_layers=self.n_layers, hidden=self.hidden, vocab=vocab, n_head=self.n_head,
            n_head_kv=self.n_head_kv, head_dim=self.head_dim, rms_eps=self.rms_eps,
            rope_theta=self.rope_theta, rope_dim=self.rope_dim, n_expert=self.n_expert,
            n_expert_used=self.n_expert_used, expert_ffn=self.expert_ffn, shared_ffn=self.shared_ffn,
            conv_kernel=self.conv_kernel, gdn_k_heads=self.gdn_k_heads, gdn_v_heads=self.gdn_v_heads,
            gdn_head_k=self.gdn_head_dim, gdn_head_v=self.gdn_head_dim,
            full_attention_interval=self.full_attention_interval,
            context_length=self.context_length, rope_sections=self.rope_sections + (0,))  # GGUF pads to 4

    def hf_config(self, vocab: int, *, bos_id: int | None = None, eos_id: int | None = None,
                  pad_id: int | None = None, **options: Any):
        """The transformers ``Qwen3_5MoeTextConfig`` of this shape; ``options`` pass through."""
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            vocab_size=vocab, hidden_size=self.hidden, num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_head, num_key_value_heads=self.n_head_kv, head_dim=self.head_dim,
            linear_num_key_heads=self.gdn_k_heads, linear_num_value_heads=self.gdn_v_heads,
            linear_key_head_dim=self.gdn_head_dim, linear_value_head_dim=self.gdn_head_dim,
            linear_conv_kernel_dim=self.conv_kernel, num_experts=self.n_expert,
            num_experts_per_tok=self.n_expert_used, moe_intermediate_size=self.expert_ffn,
            shared_expert_intermediate_size=self.shared_ffn, rms_norm_eps=self.rms_eps,
            max_position_embeddings=self.context_length, tie_word_embeddings=False,
            layer_types=["full_attention" if (i + 1) % self.full_attention_interval == 0
                         else "linear_attention" for i in range(self.n_layers)],
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary,
                             "mrope_section": list(self.rope_sections)},
            bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, **options)

    def param_count(self, vocab: int) -> int:
        return sum(_numel(s) for s in expected_tensors(self.model_config(vocab)).values())

    def active_param_count(self, vocab: int) -> int:
        """Parameters one token touches (top-k of the routed experts), embedding row excluded."""
        per_expert = 3 * self.hidden * self.expert_ffn
        unused = (self.n_expert - self.n_expert_used) * per_expert * self.n_layers
        return self.param_count(vocab) - unused - vocab * self.hidden

    def tensor_bytes(self, vocab: int, quant: str = "q8_0") -> int:
        """Bytes of tensor data in a file converted to ``quant`` (llama.cpp's per-tensor type rules)."""
        from engine.gguf.convert_hf import QUANTS, tensor_type
        from engine.gguf.quants import tensor_nbytes

        qtype = QUANTS[quant][0]
        return sum(tensor_nbytes(tensor_type(name, shape, qtype), shape)
                   for name, shape in expected_tensors(self.model_config(vocab)).items())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


TARGET = ModelShape(
    name="target", n_layers=8, hidden=256, n_head=4, n_head_kv=2, head_dim=64,
    gdn_k_heads=2, gdn_v_heads=4, gdn_head_dim=64, n_expert=32, n_expert_used=4,
    expert_ffn=64, shared_ffn=128)

DRAFTER = ModelShape(
    name="drafter", n_layers=4, hidden=128, n_head=2, n_head_kv=1, head_dim=64,
    gdn_k_heads=1, gdn_v_heads=2, gdn_head_dim=64, n_expert=8, n_expert_used=2,
    expert_ffn=64, shared_ffn=128)

# A CPU-sized member for tests: every feature of the real shapes, a few seconds to train.
MICRO = ModelShape(
    name="micro", n_layers=4, hidden=64, n_head=2, n_head_kv=1, head_dim=32,
    gdn_k_heads=1, gdn_v_heads=2, gdn_head_dim=32, n_expert=16, n_expert_used=4,
    expert_ffn=32, shared_ffn=64)

SHAPES = {s.name: s for s in (TARGET, DRAFTER, MICRO)}

# Bytes all shipped files may take together (target + drafter + DFlash draft).
SHIPPED_BUDGET_BYTES = 40 * 10**6
TARGET_BUDGET_BYTES = 25 * 10**6


def shape(name: str) -> ModelShape:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; expected one of {sorted(SHAPES)}")
    return SHAPES[name]
