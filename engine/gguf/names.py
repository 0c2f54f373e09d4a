"""Tensor names of the qwen35moe architecture and the shapes a config implies.

Names follow gguf-py's ``MODEL_TENSORS[MODEL_ARCH.QWEN35MOE]``; shapes are torch order
(GGUF ``ne`` reversed) as llama.cpp's converter writes them, which llama.cpp's loader
(``src/models/qwen35moe.cpp``) accepts. The one tensor whose written shape differs from the
loader's is ``ffn_gate_inp_shexp``: written [1, hidden] (HF's ``shared_expert_gate``, not
squeezed), loaded as ``{n_embd}`` (ggml ignores trailing 1s).
"""

from __future__ import annotations

from engine.model.config import ModelConfig

Shape = tuple[int, ...]


def layer_tensors(cfg: ModelConfig, layer: int, *, fused_experts: bool = False) -> dict[str, Shape]:
    """Every tensor block ``layer`` must hold, with its shape."""
    p = f"blk.{layer}."
    h = cfg.hidden
    t: dict[str, Shape] = {
        p + "attn_norm.weight": (h,),
        p + "post_attention_norm.weight": (h,),
    }
    if cfg.is_attention(layer):
        q_dim = cfg.n_head * cfg.head_dim
        kv_dim = cfg.n_head_kv * cfg.head_dim
        t |= {
            p + "attn_q.weight": (2 * q_dim, h),  # per head [q | gate]
            p + "attn_k.weight": (kv_dim, h),
            p + "attn_v.weight": (kv_dim, h),
            p + "attn_output.weight": (h, q_dim),
            p + "attn_q_norm.weight": (cfg.head_dim,),
            p + "attn_k_norm.weight": (cfg.head_dim,),
        }
    else:
        t |= {
            p + "attn_qkv.weight": (cfg.gdn_conv_dim, h),
            p + "attn_gate.weight": (cfg.gdn_value_dim, h),
            p + "ssm_conv1d.weight": (cfg.gdn_conv_dim, cfg.conv_kernel),
            p + "ssm_dt.bias": (cfg.gdn_v_heads,),
            p + "ssm_a": (cfg.gdn_v_heads,),
            p + "ssm_beta.weight": (cfg.gdn_v_heads, h),
            p + "ssm_alpha.weight": (cfg.gdn_v_heads, h),
            p + "ssm_norm.weight": (cfg.gdn_head_v,),
            p + "ssm_out.weight": (h, cfg.gdn_value_dim),
        }
    t[p + "ffn_gate_inp.weight"] = (cfg.n_expert, h)
    if fused_experts:
        t[p + "ffn_gate_up_exps.weight"] = (cfg.n_expert, 2 * cfg.expert_ffn, h)
    else:
        t[p + "ffn_gate_exps.weight"] = (cfg.n_expert, cfg.expert_ffn, h)
        t[p + "ffn_up_exps.weight"] = (cfg.n_expert, cfg.expert_ffn, h)
    t[p + "ffn_down_exps.weight"] = (cfg.n_expert, h, cfg.expert_ffn)
    if cfg.shared_ffn:
        t |= {
            p + "ffn_gate_inp_shexp.weight": (1, h),
            p + "ffn_gate_shexp.weight": (cfg.shared_ffn, h),
            p + "ffn_up_shexp.weight": (cfg.shared_ffn, h),
            p + "ffn_down_shexp.weight": (h, cfg.shared_ffn),
        }
    return t


def expected_tensors(cfg: ModelConfig, *, fused_experts: bool = False) -> dict[str, Shape]:
    """All tensors the engine needs from a qwen35moe file (an MTP block is not included)."""
    t: dict[str, Shape] = {
        "token_embd.weight": (cfg.vocab, cfg.hidden),
        "output_norm.weight": (cfg.hidden,),
        "output.weight": (cfg.vocab, cfg.hidden),
    }
    for layer in range(cfg.n_layers):
        t |= layer_tensors(cfg, layer, fused_experts=fused_experts)
    return t


EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
                   "ffn_gate_up_exps.weight")


def is_expert_tensor(name: str) -> bool:
    return name.endswith(EXPERT_SUFFIXES)
