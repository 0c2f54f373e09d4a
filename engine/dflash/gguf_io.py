"""Draft files: the Lucebox draft GGUF layout (read and written) and z-lab's safetensors layout (read).

GGUF: architecture ``qwen35-dflash-draft`` (``dflash-draft`` from llama.cpp forks is read
too), Qwen3-style hyperparameter keys under the architecture prefix plus
``<arch>.dflash.block_size``, ``.dflash.mask_token_id``, ``.dflash.target_layer_ids`` and
``.dflash.n_target_layers`` (the number of captured target layers, as Lucebox writes it).
Tensors ``dflash.fc.weight``, ``dflash.hidden_norm.weight``, ``output_norm.weight`` and
``blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm,
ffn_gate, ffn_up, ffn_down}.weight``. Norms are plain multipliers in both layouts (Qwen3's
RMSNorm stores the multiplier itself, unlike qwen35moe's ``1 + w``).

z-lab: a directory with ``config.json`` (``dflash_config`` holding ``target_layer_ids``,
``mask_token_id`` and ``block_size``) and ``model.safetensors`` with HF names (``fc``,
``hidden_norm``, ``norm``, ``layers.N.self_attn.q_proj`` ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from engine.dflash.draft import DFlashDraft, DraftConfig
from engine.errors import GGUFError
from engine.gguf.reader import GGUFFile
from engine.gguf.writer import TensorSpec, write_gguf

ARCH = "qwen35-dflash-draft"
READ_ARCHS = (ARCH, "dflash-draft")

# draft parameter -> (GGUF name, z-lab name); "{i}" is the layer
_TOP = {"fc": ("dflash.fc.weight", "fc.weight"),
        "hidden_norm": ("dflash.hidden_norm.weight", "hidden_norm.weight"),
        "norm": ("output_norm.weight", "norm.weight")}
_LAYER = {"attn_norm": ("attn_norm", "input_layernorm"),
          "q": ("attn_q", "self_attn.q_proj"), "k": ("attn_k", "self_attn.k_proj"),
          "v": ("attn_v", "self_attn.v_proj"), "o": ("attn_output", "self_attn.o_proj"),
          "q_norm": ("attn_q_norm", "self_attn.q_norm"), "k_norm": ("attn_k_norm", "self_attn.k_norm"),
          "ffn_norm": ("ffn_norm", "post_attention_layernorm"),
          "gate": ("ffn_gate", "mlp.gate_proj"), "up": ("ffn_up", "mlp.up_proj"),
          "down": ("ffn_down", "mlp.down_proj")}
# names other converters use for the same GGUF tensors
_GGUF_ALIASES = {"dflash.fc.weight": "dflash_fc.weight", "dflash.hidden_norm.weight": "dflash_hidden_norm.weight"}
_LAYER_ALIASES = {"ffn_norm": "post_attention_norm"}

WRITE_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}


def gguf_tensor_names(cfg: DraftConfig) -> dict[str, str]:
    """Draft parameter name (``layers.3.q``) -> GGUF tensor name (``blk.3.attn_q.weight``)."""
    names = {param: gguf for param, (gguf, _) in _TOP.items()}
    for i in range(cfg.n_layers):
        names |= {f"layers.{i}.{param}": f"blk.{i}.{gguf}.weight" for param, (gguf, _) in _LAYER.items()}
    return names


def zlab_tensor_names(cfg: DraftConfig) -> dict[str, str]:
    """Draft parameter name -> z-lab safetensors name."""
    names = {param: hf for param, (_, hf) in _TOP.items()}
    for i in range(cfg.n_layers):
        names |= {f"layers.{i}.{param}": f"layers.{i}.{hf}.weight" for param, (_, hf) in _LAYER.items()}
    return names


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Draft parameter name -> torch shape."""
    h, q_dim, kv_dim = cfg.hidden, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"fc": (h, cfg.n_features * h), "hidden_norm": (h,), "norm": (h,)}
    per_layer = {"attn_norm": (h,), "q": (q_dim, h), "k": (kv_dim, h), "v": (kv_dim, h), "o": (h, q_dim),
                 "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,), "ffn_norm": (h,),
                 "gate": (cfg.ffn, h), "up": (cfg.ffn, h), "down": (h, cfg.ffn)}
    for i in range(cfg.n_layers):
        shapes |= {f"layers.{i}.{k}": v for k, v in per_layer.items()}
    return shapes


def config_from_metadata(md: Mapping[str, Any], *, source: str) -> DraftConfig:
    """A DraftConfig from a draft GGUF's key/values (no tensor is read)."""
    arch = md.get("general.architecture")
    if arch not in READ_ARCHS:
        raise GGUFError(f"{source}: architecture is {arch!r}, expected {ARCH!r} (a DFlash draft)")

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full in md:
            return md[full]
        if default is None:
            raise GGUFError(f"{source}: metadata key {full!r} is missing")
        return default

    ids = get("dflash.target_layer_ids")
    if not isinstance(ids, list) or not ids:
        raise GGUFError(f"{source}: {arch}.dflash.target_layer_ids must be a non-empty list, got {ids!r}")
    n_target = int(get("dflash.n_target_layers", len(ids)))
    if n_target != len(ids):
        raise GGUFError(f"{source}: {arch}.dflash.n_target_layers is {n_target} but "
                        f"dflash.target_layer_ids lists {len(ids)} layers")
    head_dim = int(get("attention.key_length"))
    value_length = int(get("attention.value_length", head_dim))
    if value_length != head_dim:
        raise GGUFError(f"{source}: {arch}.attention.value_length {value_length} differs from key_length {head_dim}")
    pattern = md.get(f"{arch}.attention.sliding_window_pattern", [])
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
    try:
        return DraftConfig(
            n_layers=int(get("block_count")), hidden=int(get("embedding_length")),
            ffn=int(get("feed_forward_length")), n_head=int(get("attention.head_count")),
            n_head_kv=int(get("attention.head_count_kv")), head_dim=head_dim,
            rms_eps=float(get("attention.layer_norm_rms_epsilon")), rope_theta=float(get("rope.freq_base")),
            rope_dim=int(get("rope.dimension_count", head_dim)),
            block_size=int(get("dflash.block_size")), mask_token_id=int(get("dflash.mask_token_id")),
            target_layer_ids=tuple(int(i) for i in ids), vocab=int(vocab),
            context_length=int(get("context_length", 32768)),
            sliding_window=int(md.get(f"{arch}.attention.sliding_window", 0)),
            swa_layers=tuple(bool(p) for p in pattern), causal=bool(md.get(f"{arch}.attention.causal", False)),
        )
    except ValueError as exc:
        raise GGUFError(f"{source}: inconsistent draft hyperparameters: {exc}") from None


def config_to_metadata(cfg: DraftConfig) -> dict[str, Any]:
    """The ``qwen35-dflash-draft.*`` keys of a config (the inverse of ``config_from_metadata``)."""
    md: dict[str, Any] = {
        "block_count": cfg.n_layers, "context_length": cfg.context_length, "embedding_length": cfg.hidden,
        "feed_forward_length": cfg.ffn, "attention.head_count": cfg.n_head,
        "attention.head_count_kv": cfg.n_head_kv, "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim, "attention.layer_norm_rms_epsilon": cfg.rms_eps,
        "rope.freq_base": cfg.rope_theta, "rope.dimension_count": cfg.rope_dim,
        "dflash.block_size": cfg.block_size, "dflash.mask_token_id": cfg.mask_token_id,
        "dflash.target_layer_ids": [int(i) for i in cfg.target_layer_ids],
        "dflash.n_target_layers": cfg.n_features,
    }
    if cfg.vocab:
        md["vocab_size"] = cfg.vocab
    if cfg.sliding_window:
        md["attention.sliding_window"] = cfg.sliding_window
        if cfg.swa_layers:
            md["attention.sliding_window_pattern"] = [bool(s) for s in cfg.swa_layers]
    if cfg.causal:
        md["attention.causal"] = True
    return {"general.architecture": ARCH} | {f"{ARCH}.{k}": v for k, v in md.items()}


def config_from_zlab(config: Mapping[str, Any], *, source: str) -> DraftConfig:
    """A DraftConfig from z-lab's ``config.json``."""
    arch = (config.get("architectures") or ["DFlashDraftModel"])[0]
    if arch != "DFlashDraftModel":
        raise GGUFError(f"{source}: architecture {arch!r} is not supported, expected 'DFlashDraftModel'")
    dflash = config.get("dflash_config", {})

    def get(key: str, default: Any = None) -> Any:
        value = dflash.get(key, config.get(key, default))
        if value is None:
            raise GGUFError(f"{source}: config key {key!r} is missing")
        return value

    for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        value = dflash.get(key, config.get(key, neutral))
        if value != neutral:
            raise GGUFError(f"{source}: {key} = {value} is not supported (only plain DFlash drafts are)")
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise GGUFError(f"{source}: config key 'rope_theta' is missing")
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise GGUFError(f"{source}: rope scaling {rope.get('rope_type') or config.get('rope_scaling')!r} "
                        "is not supported (only plain RoPE)")
    layer_types = config.get("layer_types") or []
    swa = tuple(t == "sliding_attention" for t in layer_types)
    window = int(config.get("sliding_window") or 0) if any(swa) and config.get("use_sliding_window", True) else 0
    hidden, n_head = int(get("hidden_size")), int(get("num_attention_heads"))
    causal = config.get("is_causal")
    if causal is None and 0 < sum(swa) < len(swa):
        raise GGUFError(f"{source}: layers that differ in causality (layer_types {layer_types}) are not supported")
    try:
        return DraftConfig(
            n_layers=int(get("num_hidden_layers")), hidden=hidden, ffn=int(get("intermediate_size")),
            n_head=n_head, n_head_kv=int(get("num_key_value_heads")),
            head_dim=int(config.get("head_dim") or hidden // n_head), rms_eps=float(get("rms_norm_eps")),
            rope_theta=float(theta), block_size=int(get("block_size", 16)),
            mask_token_id=int(get("mask_token_id")), target_layer_ids=tuple(int(i) for i in get("target_layer_ids")),
            vocab=int(config.get("vocab_size") or 0),
            context_length=int(config.get("max_position_embeddings") or 32768),
            sliding_window=window, swa_layers=swa if window else (),
            causal=any(swa) if causal is None else bool(causal),
        )
    except ValueError as exc:
        raise GGUFError(f"{source}: inconsistent draft hyperparameters: {exc}") from None


@dataclass(frozen=True)
class DraftFile:
    """A draft on disk, opened for its metadata only: nothing is loaded yet."""

    path: Path
    layout: str  # "gguf" or "zlab"
    cfg: DraftConfig

    @classmethod
    def open(cls, path: str | Path) -> "DraftFile":
        path = Path(path)
        if path.is_dir() or path.suffix == ".safetensors" or path.name == "config.json":
            directory = path if path.is_dir() else path.parent
            config_path = directory / "config.json"
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise GGUFError(f"{path}: a z-lab draft needs {config_path}, which does not exist") from None
            except (OSError, json.JSONDecodeError) as exc:
                raise GGUFError(f"{config_path}: cannot be read as JSON ({exc})") from None
            return cls(directory, "zlab", config_from_zlab(config, source=str(config_path)))
        with GGUFFile(path) as f:
            return cls(path, "gguf", config_from_metadata(f.metadata, source=str(path)))

    def load(self, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> DFlashDraft:
        """Check every tensor's shape, then build the draft on ``device`` (norms stay float32)."""
        draft = DFlashDraft(self.cfg, device="meta")
        shapes = expected_shapes(self.cfg)
        if self.layout == "gguf":
            with GGUFFile(self.path) as f:
                names = {p: _resolve_gguf_name(n, f.tensors) for p, n in gguf_tensor_names(self.cfg).items()}
                f.check_tensors({names[p]: s for p, s in shapes.items()})
                tensors = {p: f.load(names[p], dtype=_param_dtype(s, dtype), device=device) for p, s in shapes.items()}
        else:
            tensors = _load_zlab(self.path, self.cfg, shapes, device=device, dtype=dtype)
        draft.load_state_dict(tensors, assign=True)
        draft.requires_grad_(False)
        return draft


def load_draft(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> DFlashDraft:
    return DraftFile.open(path).load(device=device, dtype=dtype)


def write_draft_gguf(draft: DFlashDraft, path: str | Path, *, qtype: str = "bf16",
                     extra_metadata: Mapping[str, Any] | None = None,
                     progress: Callable[[int, int], None] | None = None) -> Path:
    """Write ``draft`` in the Lucebox layout: matrices in ``qtype``, norms in F32."""
    if qtype not in WRITE_TYPES:
        raise ValueError(f"draft weight type {qtype!r} is not one of {sorted(WRITE_TYPES)}")
    params = dict(draft.named_parameters())
    specs = []
    for param, name in gguf_tensor_names(draft.cfg).items():
        t = params[param].detach()
        q = WRITE_TYPES[qtype] if t.dim() == 2 else Q.F32
        specs.append(TensorSpec(name, tuple(t.shape), q, _producer(t, q)))
    metadata = config_to_metadata(draft.cfg) | {"general.name": Path(path).stem} | dict(extra_metadata or {})
    return write_gguf(path, metadata, specs, progress=progress)


def _producer(t: torch.Tensor, qtype: Q) -> Callable[[], np.ndarray]:
    def produce() -> np.ndarray:
        cpu = t.to("cpu")
        if qtype == Q.F32:
            return cpu.float().contiguous().view(torch.uint8).numpy()
        if qtype == Q.F16:
            return cpu.half().contiguous().view(torch.uint8).numpy()
        if qtype == Q.BF16:
            return cpu.bfloat16().contiguous().view(torch.uint8).numpy()
        return cpu.float().numpy()  # quantized by the writer
    return produce


def _param_dtype(shape: tuple[int, ...], dtype: torch.dtype) -> torch.dtype:
    return dtype if len(shape) == 2 else torch.float32


def _resolve_gguf_name(name: str, present: Mapping[str, Any]) -> str:
    if name in present:
        return name
    alias = _GGUF_ALIASES.get(name)
    if alias is None and name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        stem = rest.removesuffix(".weight")
        alias = f"blk.{layer}.{_LAYER_ALIASES[stem]}.weight" if stem in _LAYER_ALIASES else None
    return alias if alias is not None and alias in present else name


def _load_zlab(directory: Path, cfg: DraftConfig, shapes: Mapping[str, tuple[int, ...]], *,
               device: torch.device | str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise GGUFError(f"{directory}: no .safetensors file beside config.json")
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as st:
            for key in st.keys():
                where[key.removeprefix("model.")] = file
    out = {}
    for param, hf in zlab_tensor_names(cfg).items():
        file = where.get(hf)
        if file is None:
            raise GGUFError(f"{directory}: tensor {hf!r} is missing (expected shape {shapes[param]})")
        with safe_open(file, framework="pt") as st:
            key = hf if hf in st.keys() else "model." + hf
            t = st.get_tensor(key)
        if tuple(t.shape) != shapes[param]:
            raise GGUFError(f"{file}: tensor {hf!r} has shape {tuple(t.shape)}, expected {shapes[param]}")
        out[param] = t.to(device=device, dtype=_param_dtype(shapes[param], dtype))
    return out
