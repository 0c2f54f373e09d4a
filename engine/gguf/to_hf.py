"""Load a qwen35moe GGUF file into transformers' ``Qwen3_5MoeForCausalLM`` (text part).

The inverse of ``engine.gguf.convert_hf``: transformers' module runs a batch of sequences
with a cache (``generate``), which the engine's single-sequence forward does not. Every
transform goes GGUF -> HF:

- names from the explicit table below (gguf-py's names for ``MODEL_ARCH.QWEN35MOE``);
- every ``*norm.weight`` but the GDN's ``ssm_norm.weight`` was stored as ``1 + w``: ``w = t - 1``;
- ``ssm_a = -exp(A_log)``: ``A_log = log(-ssm_a)``; ``ssm_dt.bias`` -> ``dt_bias``;
  ``ssm_conv1d.weight`` [C, K] -> ``conv1d.weight`` [C, 1, K];
- GDN value heads are re-grouped from GGUF's tiled order (``engine.model.value_heads``);
- experts: ``ffn_gate_exps`` and ``ffn_up_exps`` [E, F, H] (or a fused ``ffn_gate_up_exps``
  [E, 2F, H]) -> ``gate_up_proj`` [E, 2F, H], gate first; ``ffn_down_exps`` -> ``down_proj``;
  ``ffn_gate_inp_shexp`` -> ``shared_expert_gate.weight`` [1, H];
- ``attn_q`` keeps its per-head ``[q | gate]`` rows, as HF's ``q_proj`` does;
- a file without ``output.weight`` ties the embeddings.

Quantized tensors are dequantized to float32 as the engine's loader does, so the module and
the engine compute with the same values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.errors import ConfigError
from engine.gguf import names
from engine.gguf.reader import GGUFFile
from engine.model.config import ModelConfig
from engine.model.value_heads import reorder_value_heads
from engine.model.weights import TensorSource, has_fused_experts

# GGUF suffix (after "blk.{i}.") -> HF name (after "model.layers.{i}."), experts aside
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def hf_config(cfg: ModelConfig, *, tied: bool = False, **options: Any):
    """The transformers ``Qwen3_5MoeTextConfig`` of a qwen35moe file (the inverse of ``config_from_hf``).

    ``options`` pass through (``experts_implementation``, token ids...).
    """
    from transformers import Qwen3_5MoeTextConfig

    if not cfg.shared_ffn:
        raise ConfigError("the model has no shared expert, which transformers' Qwen3_5Moe always has")
    pairs = cfg.rope_dim // 2
    sections = list(cfg.rope_sections[:3]) if cfg.rope_sections else [pairs, 0, 0]
    return Qwen3_5MoeTextConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv, head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.gdn_k_heads, linear_num_value_heads=cfg.gdn_v_heads,
        linear_key_head_dim=cfg.gdn_head_k, linear_value_head_dim=cfg.gdn_head_v,
        linear_conv_kernel_dim=cfg.conv_kernel, num_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_used,
        moe_intermediate_size=cfg.expert_ffn, shared_expert_intermediate_size=cfg.shared_ffn,
        rms_norm_eps=cfg.rms_eps, max_position_embeddings=cfg.context_length, tie_word_embeddings=tied,
        layer_types=["full_attention" if cfg.is_attention(i) else "linear_attention" for i in range(cfg.n_layers)],
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.rope_dim / cfg.head_dim, "mrope_section": sections},
        **options)


def _hf_value(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """GGUF values of tensor ``name`` (float32, torch order) -> HF values."""
    t = reorder_value_heads(name, t, cfg, to="grouped")
    if name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
        return t - 1
    if name.endswith(".ssm_a"):
        return torch.log(-t)
    if name.endswith(".ssm_conv1d.weight"):
        return t.unsqueeze(1)
    if name.endswith(".ffn_gate_inp_shexp.weight"):
        return t.reshape(1, cfg.hidden)
    return t


def hf_state_dict(source: TensorSource, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The float32 state dict of ``Qwen3_5MoeForCausalLM`` holding the file's weights (CPU)."""
    fused = has_fused_experts(source)
    expected = names.expected_tensors(cfg, fused_experts=fused)
    if "output.weight" not in source.tensors:
        del expected["output.weight"]
    source.check_tensors(expected)

    def load(name: str) -> torch.Tensor:
        return _hf_value(name, source.load(name, dtype=torch.float32, device="cpu"), cfg)

    sd = {hf: load(gguf) for gguf, hf in _GLOBAL_NAMES.items() if gguf in expected}
    for i in range(cfg.n_layers):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        for suffix, hf in _LAYER_NAMES.items():
            if p + suffix in expected:
                sd[q + hf] = load(p + suffix)
        if fused:
            sd[q + "mlp.experts.gate_up_proj"] = load(p + "ffn_gate_up_exps.weight")
        else:
            sd[q + "mlp.experts.gate_up_proj"] = torch.cat([load(p + "ffn_gate_exps.weight"),
                                                            load(p + "ffn_up_exps.weight")], dim=1)
    return sd


def hf_model_from_gguf(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       use_fla: bool | None = None, **options: Any):
    """transformers' ``Qwen3_5MoeForCausalLM`` holding a qwen35moe GGUF file's weights, in eval mode.

    ``use_fla`` binds fla's Gated DeltaNet kernels (default: on CUDA when fla is installed;
    see ``engine.train.train_target.hf_model_class``); ``options`` go to the config (on CUDA
    the experts default to torch's grouped GEMM).
    """
    import importlib.util

    from engine.train.train_target import experts_implementation_for, hf_model_class

    device = torch.device(device)
    if use_fla is None:
        use_fla = device.type == "cuda" and importlib.util.find_spec("fla") is not None
    experts = experts_implementation_for(device)
    if experts is not None:
        options.setdefault("experts_implementation", experts)
    with GGUFFile(path) as f:
        cfg = ModelConfig.from_metadata(f.metadata, source=str(path))
        sd = hf_state_dict(f, cfg)
    model_class, _ = hf_model_class(use_fla)
    model = model_class(hf_config(cfg, tied="lm_head.weight" not in sd, **options))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and "lm_head.weight" not in sd)]
    if missing or unexpected:
        raise ConfigError(f"{path}: the HF module lacks {unexpected[:1]} or the file lacks {missing[:1]}")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
