"""Hyperparameters of a qwen35moe model, read from GGUF metadata (nothing hard-coded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from engine.errors import GGUFError

ARCH = "qwen35moe"


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int  # transformer blocks, without an MTP block
    hidden: int
    vocab: int
    n_head: int  # attention query heads
    n_head_kv: int
    head_dim: int  # attention key/value length
    rms_eps: float
    rope_theta: float
    rope_dim: int  # rotated dims per head (NeoX pairing)
    n_expert: int
    n_expert_used: int
    expert_ffn: int
    shared_ffn: int
    conv_kernel: int
    gdn_k_heads: int  # ssm.group_count
    gdn_v_heads: int  # ssm.time_step_rank
    gdn_head_k: int  # ssm.state_size
    gdn_head_v: int  # ssm.inner_size / gdn_v_heads
    full_attention_interval: int
    context_length: int = 262144
    n_nextn: int = 0  # MTP blocks appended after n_layers (loaded, never run)
    rope_sections: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        positive = {
            "n_layers": self.n_layers, "hidden": self.hidden, "vocab": self.vocab,
            "n_head": self.n_head, "n_head_kv": self.n_head_kv, "head_dim": self.head_dim,
            "n_expert": self.n_expert, "n_expert_used": self.n_expert_used,
            "expert_ffn": self.expert_ffn, "conv_kernel": self.conv_kernel,
            "gdn_k_heads": self.gdn_k_heads, "gdn_v_heads": self.gdn_v_heads,
            "gdn_head_k": self.gdn_head_k, "gdn_head_v": self.gdn_head_v,
            "full_attention_interval": self.full_attention_interval,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.gdn_v_heads % self.gdn_k_heads:
            raise ValueError(
                f"GDN value heads {self.gdn_v_heads} are not a multiple of key heads {self.gdn_k_heads}")
        if self.n_expert_used > self.n_expert:
            raise ValueError(f"expert_used_count {self.n_expert_used} exceeds expert_count {self.n_expert}")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope dimension_count {self.rope_dim} must be even and at most {self.head_dim}")

    def is_attention(self, layer: int) -> bool:
        """Layer i is full (gated) attention when (i + 1) % interval == 0, else Gated DeltaNet."""
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_attention(i)]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if not self.is_attention(i)]

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_k_heads * self.gdn_head_k

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_v_heads * self.gdn_head_v

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], *, source: str = "GGUF") -> "ModelConfig":
        """Build from GGUF key/values (``qwen35moe.*``); ``source`` names the file in errors."""
        arch = md.get("general.architecture")
        if arch != ARCH:
            raise GGUFError(f"{source}: architecture is {arch!r}, expected {ARCH!r}")

        def get(key: str, default: Any = None) -> Any:
            full = f"{ARCH}.{key}"
            if full in md:
                return md[full]
            if default is None:
                raise GGUFError(f"{source}: metadata key {full!r} is missing")
            return default

        block_count = int(get("block_count"))
        n_nextn = int(get("nextn_predict_layers", 0))
        v_heads = int(get("ssm.time_step_rank"))
        inner = int(get("ssm.inner_size"))
        if inner % v_heads:
            raise GGUFError(f"{source}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {v_heads}")
        head_dim = int(get("attention.key_length"))
        value_length = int(get("attention.value_length", head_dim))
        if value_length != head_dim:
            raise GGUFError(
                f"{source}: attention.value_length {value_length} differs from key_length {head_dim}")
        sections = md.get(f"{ARCH}.rope.dimension_sections", ())
        try:
            return cls(
                n_layers=block_count - n_nextn,
                hidden=int(get("embedding_length")),
                vocab=int(md.get(f"{ARCH}.vocab_size") or _vocab_from_tokens(md, source)),
                n_head=int(get("attention.head_count")),
                n_head_kv=int(get("attention.head_count_kv")),
                head_dim=head_dim,
                rms_eps=float(get("attention.layer_norm_rms_epsilon")),
                rope_theta=float(get("rope.freq_base")),
                rope_dim=int(get("rope.dimension_count")),
                n_expert=int(get("expert_count")),
                n_expert_used=int(get("expert_used_count")),
                expert_ffn=int(get("expert_feed_forward_length")),
                shared_ffn=int(get("expert_shared_feed_forward_length", 0) or 0),
                conv_kernel=int(get("ssm.conv_kernel")),
                gdn_k_heads=int(get("ssm.group_count")),
                gdn_v_heads=v_heads,
                gdn_head_k=int(get("ssm.state_size")),
                gdn_head_v=inner // v_heads,
                full_attention_interval=int(get("full_attention_interval")),
                context_length=int(get("context_length", 262144)),
                n_nextn=n_nextn,
                rope_sections=tuple(int(s) for s in sections),
            )
        except ValueError as exc:
            raise GGUFError(f"{source}: inconsistent hyperparameters: {exc}") from None

    def to_metadata(self) -> dict[str, Any]:
        """The ``qwen35moe.*`` keys this config writes (the inverse of ``from_metadata``)."""
        md: dict[str, Any] = {
            "block_count": self.n_layers + self.n_nextn,
            "context_length": self.context_length,
            "embedding_length": self.hidden,
            "attention.head_count": self.n_head,
            "attention.head_count_kv": self.n_head_kv,
            "attention.key_length": self.head_dim,
            "attention.value_length": self.head_dim,
            "attention.layer_norm_rms_epsilon": self.rms_eps,
            "rope.freq_base": self.rope_theta,
            "rope.dimension_count": self.rope_dim,
            "expert_count": self.n_expert,
            "expert_used_count": self.n_expert_used,
            "expert_feed_forward_length": self.expert_ffn,
            "expert_shared_feed_forward_length": self.shared_ffn,
            "ssm.conv_kernel": self.conv_kernel,
            "ssm.state_size": self.gdn_head_k,
            "ssm.group_count": self.gdn_k_heads,
            "ssm.time_step_rank": self.gdn_v_heads,
            "ssm.inner_size": self.gdn_value_dim,
            "full_attention_interval": self.full_attention_interval,
        }
        if self.rope_sections:
            md["rope.dimension_sections"] = list(self.rope_sections)
        if self.n_nextn:
            md["nextn_predict_layers"] = self.n_nextn
        return {f"{ARCH}.{k}": v for k, v in md.items()}


def _vocab_from_tokens(md: Mapping[str, Any], source: str) -> int:
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFError(f"{source}: neither {ARCH}.vocab_size nor tokenizer.ggml.tokens is present")
    return len(tokens)
