"""Convert a HF ``Qwen3_5MoeForCausalLM`` checkpoint (text part) to a qwen35moe GGUF file.

Follows llama.cpp's ``convert_hf_to_gguf.py`` (``Qwen3_5MoeTextModel`` <-
``_LinearAttentionVReorderBase`` <- ``Qwen3NextModel`` <- ``Qwen2MoeModel`` <- ``TextModel``)
so that its files and ours are interchangeable. Every transform goes HF -> GGUF:

- names through gguf-py's tensor map for ``MODEL_ARCH.QWEN35MOE``; ``model.language_model.``
  becomes ``model.``; vision (``model.visual.``) and MTP (``mtp.``) tensors are skipped, as
  llama.cpp's converter does;
- every ``*norm.weight`` but the GDN's ``linear_attn.norm.weight`` is stored as ``1 + w``;
- ``A_log`` -> ``ssm_a = -exp(A_log)``; ``dt_bias`` -> ``ssm_dt.bias``; ``conv1d.weight``
  [C, 1, K] is squeezed to [C, K];
- GDN value heads are re-tiled from HF's grouped order (see ``engine.model.value_heads``);
- experts: fused ``gate_up_proj`` [E, 2F, H] is split at F into ``ffn_gate_exps`` (first
  half) and ``ffn_up_exps``; ``down_proj`` [E, H, F] is kept; per-expert
  ``experts.{e}.*_proj.weight`` tensors are stacked; ``shared_expert_gate`` [1, H] becomes
  ``ffn_gate_inp_shexp``;
- ``q_proj`` keeps HF's per-head ``[q | gate]`` interleave (llama.cpp views it per head).

Tensor types follow llama.cpp's rules: vectors, ``*_norm.weight``, ``ffn_gate_inp``,
``ffn_gate_inp_shexp``, ``ssm_conv1d`` and names not ending in ``.weight`` stay F32; the
rest take the requested type (Q8_0 falls back to F16 where rows are not multiples of 32).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import gguf
import numpy as np
import torch

from engine.errors import ConfigError
from engine.gguf import names
from engine.gguf.hf_vocab import tokenizer_metadata_from_hf
from engine.gguf.writer import write_gguf
from engine.model.config import ARCH, ModelConfig
from engine.model.value_heads import reorder_value_heads

# --outtype of llama.cpp -> (tensor type, general.file_type)
QUANTS: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
_ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

Loader = Callable[[], torch.Tensor]


def hf_text_config(config: Any) -> dict[str, Any]:
    """The text model's hyperparameters from a HF config object or ``config.json`` dict."""
    hp = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if "text_config" in hp:  # Qwen3_5MoeForConditionalGeneration: text_config wins, as in llama.cpp
        hp = {**hp, **hp["text_config"]}
    return hp


def _attention_interval(hp: Mapping[str, Any]) -> int:
    layer_types = hp.get("layer_types")
    interval = int(hp.get("full_attention_interval", 4))
    if layer_types:
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        interval = full[0] + 1 if full else len(layer_types) + 1
        pattern = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(len(layer_types))]
        if list(layer_types) != pattern:
            raise ConfigError(f"config layer_types {layer_types} is not a full attention layer every "
                              f"{interval} layers, which is all qwen35moe GGUF can describe")
    return interval


def config_from_hf(hp: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of the GGUF file llama.cpp's converter writes for these hyperparameters.

    rope.dimension_count is ``head_dim * partial_rotary_factor`` (0.25 when absent, as in
    llama.cpp); MRoPE sections are padded to four.
    """
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    sections = list(rope.get("mrope_section", ()))
    if sections:
        sections = (sections + [0, 0, 0, 0])[:4]
    try:
        head_dim = int(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
        partial = float(rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 0.25)))
        return ModelConfig(
            n_layers=int(hp["num_hidden_layers"]),
            hidden=int(hp["hidden_size"]),
            vocab=int(hp["vocab_size"]),
            n_head=int(hp["num_attention_heads"]),
            n_head_kv=int(hp["num_key_value_heads"]),
            head_dim=head_dim,
            rms_eps=float(hp["rms_norm_eps"]),
            rope_theta=float(rope.get("rope_theta", hp.get("rope_theta", 10000.0))),
            rope_dim=int(head_dim * partial),
            n_expert=int(hp["num_experts"]),
            n_expert_used=int(hp["num_experts_per_tok"]),
            expert_ffn=int(hp["moe_intermediate_size"]),
            shared_ffn=int(hp.get("shared_expert_intermediate_size") or 0),
            conv_kernel=int(hp["linear_conv_kernel_dim"]),
            gdn_k_heads=int(hp["linear_num_key_heads"]),
            gdn_v_heads=int(hp["linear_num_value_heads"]),
            gdn_head_k=int(hp["linear_key_head_dim"]),
            gdn_head_v=int(hp["linear_value_head_dim"]),
            full_attention_interval=_attention_interval(hp),
            context_length=int(hp.get("max_position_embeddings", 262144)),
            rope_sections=tuple(int(s) for s in sections),
        )
    except KeyError as exc:
        raise ConfigError(f"HF config has no {exc.args[0]!r}, which a qwen35moe model needs") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"HF config is not a valid qwen35moe model: {exc}") from None


@dataclass(frozen=True)
class HFCheckpoint:
    """Lazily readable HF tensors (names as stored) with the model's hyperparameters."""

    hparams: dict[str, Any]
    tensors: Mapping[str, Loader]
    name: str

    @classmethod
    def open(cls, source: Any, config: Any = None) -> "HFCheckpoint":
        """From a checkpoint directory, an in-memory HF model, or a state dict plus ``config``."""
        if isinstance(source, (str, Path)):
            return cls._from_dir(Path(source))
        if isinstance(source, torch.nn.Module):
            cfg = config if config is not None else getattr(source, "config", None)
            if cfg is None:
                raise ConfigError("an in-memory model without .config needs config=")
            sd = source.state_dict()
            return cls(hf_text_config(cfg), {k: (lambda t=t: t) for k, t in sd.items()}, "qwen35moe")
        if isinstance(source, Mapping):
            if config is None:
                raise ConfigError("a state dict needs config= (a HF config object or config.json dict)")
            return cls(hf_text_config(config), {k: (lambda t=t: t) for k, t in source.items()}, "qwen35moe")
        raise ConfigError(f"cannot convert a {type(source).__name__}: give a checkpoint directory, "
                          f"a HF model or a state dict")

    @classmethod
    def _from_dir(cls, path: Path) -> "HFCheckpoint":
        from safetensors import safe_open  # only checkpoint directories need it (a test extra so far)

        config_path = path / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{path}: no config.json (expected a HF checkpoint directory)")
        try:
            hp = hf_text_config(json.loads(config_path.read_text()))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{config_path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{path}: no *.safetensors files")
        tensors: dict[str, Loader] = {}
        for file in files:
            handle = safe_open(file, framework="pt")  # memory-mapped; tensors are read when asked for
            for key in handle.keys():
                tensors[key] = lambda handle=handle, key=key: handle.get_tensor(key)
        return cls(hp, tensors, path.name)


def _normalise_name(name: str) -> str | None:
    """HF checkpoint name -> the name gguf-py's map knows, or None for tensors llama.cpp skips."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    if name.endswith(".linear_attn.dt_bias"):
        return name[:-len("dt_bias")] + "dt_proj.bias"
    return name


def _gguf_transform(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF values -> GGUF values for GGUF tensor ``name`` (float32 in, float32 out)."""
    if name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
        t = t + 1
    elif name.endswith(".ssm_a"):
        t = -torch.exp(t)
    elif name.endswith(".ssm_conv1d.weight"):
        t = t.squeeze(1)
    return reorder_value_heads(name, t, cfg, to="tiled")


def gguf_tensors(ckpt: HFCheckpoint, cfg: ModelConfig) -> dict[str, Loader]:
    """GGUF tensor name -> loader of its float32 data in GGUF conventions (torch order)."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, cfg.n_layers)
    out: dict[str, Loader] = {}
    per_expert: dict[tuple[int, str], dict[int, Loader]] = {}

    def gguf_name(hf_name: str, name: str) -> str:
        mapped = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ConfigError(f"HF tensor {hf_name!r} has no qwen35moe GGUF name")
        return mapped

    def add(name: str, load: Loader) -> None:
        out[name] = lambda: _gguf_transform(name, load().float(), cfg)

    for hf_name, load in ckpt.tensors.items():
        name = _normalise_name(hf_name)
        if name is None:
            continue
        if m := _EXPERT.match(name):
            per_expert.setdefault((int(m[1]), m[3]), {})[int(m[2])] = load
            continue
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.gate_up_proj.weight"):
            base = name[:name.index(".gate_up_proj")]
            ffn = cfg.expert_ffn
            add(gguf_name(hf_name, base + ".gate_proj.weight"), lambda load=load: load()[:, :ffn])
            add(gguf_name(hf_name, base + ".up_proj.weight"), lambda load=load: load()[:, ffn:])
            continue
        if name.endswith(".mlp.experts.down_proj"):
            name += ".weight"
        add(gguf_name(hf_name, name), load)

    for (layer, proj), experts in per_expert.items():
        if sorted(experts) != list(range(cfg.n_expert)):
            raise ConfigError(f"layer {layer} {proj}: found experts {sorted(experts)}, expected 0..{cfg.n_expert - 1}")
        name = f"model.layers.{layer}.mlp.experts.{proj}.weight"
        add(gguf_name(name, name), lambda experts=experts: torch.stack([experts[e]() for e in range(cfg.n_expert)]))
    return out


def tensor_type(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """llama.cpp's choice of type for one tensor of a file converted to ``qtype``."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or name.endswith(_ALWAYS_F32) or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return gguf.GGMLQuantizationType.F16
    return qtype


def gguf_metadata(cfg: ModelConfig, *, name: str, file_type: gguf.LlamaFileType,
                  tokenizer_metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    md: dict[str, Any] = {
        "general.architecture": ARCH,
        "general.type": "model",
        "general.name": name,
        **cfg.to_metadata(),
        "general.file_type": int(file_type),
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
    }
    if tokenizer_metadata:
        tokens = tokenizer_metadata.get("tokenizer.ggml.tokens")
        if tokens is not None and len(tokens) != cfg.vocab:
            raise ConfigError(f"tokenizer metadata has {len(tokens)} tokens, the model's vocab_size is {cfg.vocab}")
        md.update(tokenizer_metadata)
    else:
        # llama.cpp takes the vocabulary size from the tokenizer; without one, say it here
        md[f"{ARCH}.vocab_size"] = cfg.vocab
    return md


def convert_hf(model_dir_or_module: Any, out_path: str | Path, *, quant: str = "f32",
               tokenizer_metadata: Mapping[str, Any] | None = None, config: Any = None) -> Path:
    """Write the GGUF file llama.cpp's converter makes of a HF Qwen3_5Moe checkpoint; return its path.

    ``model_dir_or_module``: a checkpoint directory (config.json + safetensors), an in-memory
    HF model, or a state dict with ``config``. ``quant``: f32, f16, bf16 or q8_0.
    ``tokenizer_metadata``: ``tokenizer.*`` keys to store; by default a directory's
    tokenizer.json is converted, and without either the file records ``qwen35moe.vocab_size``.
    """
    if quant not in QUANTS:
        raise ConfigError(f"unknown quant {quant!r} for conversion (choose from {', '.join(QUANTS)})")
    qtype, file_type = QUANTS[quant]
    ckpt = HFCheckpoint.open(model_dir_or_module, config)
    cfg = config_from_hf(ckpt.hparams)
    if tokenizer_metadata is None and isinstance(model_dir_or_module, (str, Path)) \
            and (Path(model_dir_or_module) / "tokenizer.json").is_file():
        tokenizer_metadata = tokenizer_metadata_from_hf(model_dir_or_module, cfg.vocab)
    loaders = gguf_tensors(ckpt, cfg)
    expected = names.expected_tensors(cfg)
    if "output.weight" not in loaders:  # tied embeddings: llama.cpp's loader reuses token_embd
        del expected["output.weight"]
    missing = [n for n in expected if n not in loaders]
    if missing:
        raise ConfigError(f"the checkpoint lacks the tensor that becomes {missing[0]!r}")
    extra = [n for n in loaders if n not in expected]
    if extra:
        raise ConfigError(f"checkpoint tensor for {extra[0]!r} does not belong to a "
                          f"{cfg.n_layers}-layer qwen35moe model")

    def producer(name: str, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
        def produce() -> np.ndarray:
            t = loaders[name]()
            if tuple(t.shape) != shape:
                raise ConfigError(f"checkpoint tensor for {name!r} has shape {tuple(t.shape)}, expected {shape}")
            return t.detach().to(torch.float32).contiguous().numpy()
        return produce

    specs = [(name, shape, tensor_type(name, shape, qtype), producer(name, shape))
             for name, shape in expected.items()]
    metadata = gguf_metadata(cfg, name=ckpt.name, file_type=file_type, tokenizer_metadata=tokenizer_metadata)
    return write_gguf(out_path, metadata, specs)
