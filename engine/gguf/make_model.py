"""Random-weight qwen35moe GGUF files with real tokenizers, for tests and benchmarks.

``tiny`` is a few-MB model for unit tests; ``qwen3.6-35b-a3b`` has the released model's exact
shapes. Weights are random but scaled so that a forward pass stays numerically sane.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType as Q, Keys, LlamaFileType, TokenType

from engine.errors import ConfigError
from engine.gguf import quants
from engine.gguf.names import expected_tensors, is_expert_tensor, layer_tensors
from engine.gguf.reader import GGUFFile
from engine.gguf.writer import TensorSpec, write_gguf
from engine.model.config import ARCH, ModelConfig

PRESETS = ("tiny", "qwen3.6-35b-a3b")
REAL_VOCAB = 248320
TINY_ORDINARY_TOKENS = 2048
VOCAB_FILE = "ggml-vocab-qwen35.gguf"
VOCAB_ENV = "LUCE_TUNE_VOCAB"

QUANTS = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0,
          "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
_FILE_TYPES = {Q.F32: LlamaFileType.ALL_F32, Q.F16: LlamaFileType.MOSTLY_F16,
               Q.BF16: LlamaFileType.MOSTLY_BF16, Q.Q8_0: LlamaFileType.MOSTLY_Q8_0,
               Q.Q4_0: LlamaFileType.MOSTLY_Q4_0, Q.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
               Q.Q5_K: LlamaFileType.MOSTLY_Q5_K_M, Q.Q6_K: LlamaFileType.MOSTLY_Q6_K}


def parse_quant(quant: str | Q) -> Q:
    """``"q4_k"`` (any case) or a GGMLQuantizationType -> a supported quant type."""
    if isinstance(quant, Q):
        if quant not in quants.SUPPORTED:
            raise ConfigError(f"quant type {quant.name} is not supported (choose from {', '.join(QUANTS)})")
        return quant
    qtype = QUANTS.get(str(quant).lower())
    if qtype is None:
        raise ConfigError(f"unknown quant {quant!r} (choose from {', '.join(QUANTS)})")
    return qtype


def preset_config(preset: str, *, vocab: int, n_layers: int | None = None, n_expert: int | None = None,
                  mtp: bool = False) -> ModelConfig:
    """Hyperparameters of a preset; ``n_layers`` and ``n_expert`` override its defaults."""
    if preset == "tiny":
        base: dict[str, Any] = dict(
            n_layers=4, hidden=64, n_head=4, n_head_kv=2, head_dim=32, rope_dim=8, n_expert=8,
            n_expert_used=2, expert_ffn=32, shared_ffn=32, gdn_k_heads=2, gdn_v_heads=4, gdn_head_k=16,
            gdn_head_v=16, rope_sections=(2, 1, 1, 0))
    elif preset == "qwen3.6-35b-a3b":
        base = dict(
            n_layers=40, hidden=2048, n_head=16, n_head_kv=2, head_dim=256, rope_dim=64, n_expert=256,
            n_expert_used=8, expert_ffn=512, shared_ffn=512, gdn_k_heads=16, gdn_v_heads=32, gdn_head_k=128,
            gdn_head_v=128, rope_sections=(11, 11, 10, 0))  # llama.cpp reads exactly 4 sections
    else:
        raise ConfigError(f"unknown model preset {preset!r} (choose from {', '.join(PRESETS)})")
    if n_layers is not None:
        base["n_layers"] = n_layers
    if n_expert is not None:
        base["n_expert"] = n_expert
    try:
        return ModelConfig(vocab=vocab, rms_eps=1e-6, rope_theta=1e7, conv_kernel=4, full_attention_interval=4,
                           context_length=262144, n_nextn=int(mtp), **base)
    except ValueError as exc:
        raise ConfigError(f"preset {preset!r}: {exc}") from None


def default_vocab_path() -> Path:
    """The vocabulary GGUF: ``$LUCE_TUNE_VOCAB``, else ``shared/data/`` beside or above the checkout."""
    if os.environ.get(VOCAB_ENV):
        return Path(os.environ[VOCAB_ENV])
    root = Path(__file__).resolve().parents[2]
    for base in (root, root.parent):
        candidate = base / "shared" / "data" / VOCAB_FILE
        if candidate.is_file():
            return candidate
    raise ConfigError(f"no {VOCAB_FILE} found under shared/data: pass vocab_path or set {VOCAB_ENV}")


def tokenizer_metadata(vocab_path: Path, *, n_ordinary: int | None = None, pad_to: int | None = None) -> dict[str, Any]:
    """``tokenizer.*`` keys of a vocabulary GGUF, truncated or padded.

    ``n_ordinary`` keeps that many ordinary tokens, the merges whose parts and result survive,
    and every special token renumbered after them. ``pad_to`` appends UNUSED tokens.
    """
    with GGUFFile(vocab_path) as f:
        md = {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}
    tokens, types = md.get(Keys.Tokenizer.LIST), md.get(Keys.Tokenizer.TOKEN_TYPE)
    if tokens is None or types is None or len(tokens) != len(types):
        raise ConfigError(f"{vocab_path}: tokenizer.ggml.tokens and token_type are missing or differ in length")
    if n_ordinary is not None:
        ordinary = [i for i, t in enumerate(types) if t == TokenType.NORMAL][:n_ordinary]
        special = [i for i, t in enumerate(types) if t != TokenType.NORMAL]
        order = ordinary + special
        new_id = {old: new for new, old in enumerate(order)}
        kept = {tokens[i] for i in ordinary}
        md[Keys.Tokenizer.LIST] = [tokens[i] for i in order]
        md[Keys.Tokenizer.TOKEN_TYPE] = [types[i] for i in order]
        if Keys.Tokenizer.SCORES in md:
            md[Keys.Tokenizer.SCORES] = [md[Keys.Tokenizer.SCORES][i] for i in order]
        if Keys.Tokenizer.MERGES in md:
            md[Keys.Tokenizer.MERGES] = [m for m in md[Keys.Tokenizer.MERGES] if _merge_survives(m, kept)]
        for key in [k for k in md if k.endswith("_token_id")]:
            if md[key] in new_id:
                md[key] = new_id[md[key]]
            else:
                del md[key]
    if pad_to is not None:
        n = len(md[Keys.Tokenizer.LIST])
        if pad_to < n:
            raise ConfigError(f"{vocab_path}: {n} tokens do not fit a vocabulary of {pad_to}")
        md[Keys.Tokenizer.LIST] = md[Keys.Tokenizer.LIST] + [f"[PAD{i}]" for i in range(n, pad_to)]
        md[Keys.Tokenizer.TOKEN_TYPE] = md[Keys.Tokenizer.TOKEN_TYPE] + [int(TokenType.UNUSED)] * (pad_to - n)
        if Keys.Tokenizer.SCORES in md:
            md[Keys.Tokenizer.SCORES] = md[Keys.Tokenizer.SCORES] + [0.0] * (pad_to - n)
    return md


def _merge_survives(merge: str, kept: set[str]) -> bool:
    left, sep, right = merge.partition(" ")
    return bool(sep) and left in kept and right in kept and left + right in kept


def tensor_qtype(name: str, shape: tuple[int, ...], quant: Q, expert_quant: Q | None = None) -> Q:
    """The type a tensor is stored in, by llama.cpp's rules.

    Norms, 1-D tensors, the routers (experts and shared-expert gate) and the conv kernel stay F32; a type whose block does not
    divide the row falls back to Q8_0, then F16 (llama.cpp's own fallbacks, Q5_0/Q5_1, are
    not among the supported types).
    """
    if (len(shape) < 2 or not name.endswith("weight") or name.endswith("norm.weight")
            or name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")) or "ssm_conv1d" in name):
        return Q.F32
    qtype = expert_quant if expert_quant is not None and is_expert_tensor(name) else quant
    for candidate in (qtype, Q.Q8_0, Q.F16):
        if shape[-1] % GGML_QUANT_SIZES[candidate][0] == 0:
            return candidate
    return Q.F16


def mtp_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The appended MTP block (index ``cfg.n_layers``): a full-attention block plus nextn tensors."""
    attn_layer = cfg.attention_layers[0] if cfg.attention_layers else cfg.full_attention_interval - 1
    src, dst = f"blk.{attn_layer}.", f"blk.{cfg.n_layers}."
    t = {dst + k[len(src):]: s for k, s in layer_tensors(cfg, attn_layer).items()}
    h = cfg.hidden
    t |= {dst + "nextn.eh_proj.weight": (h, 2 * h), dst + "nextn.enorm.weight": (h,),
          dst + "nextn.hnorm.weight": (h,), dst + "nextn.shared_head_norm.weight": (h,)}
    return t


class _Weights:
    """Random values of each tensor, seeded per tensor name so files are reproducible."""

    def __init__(self, cfg: ModelConfig, seed: int, router_skew: float) -> None:
        self.cfg, self.seed, self.router_skew = cfg, seed, router_skew
        direction = self.rng("shared_direction").standard_normal(cfg.hidden)
        self.direction = (direction / np.linalg.norm(direction)).astype(np.float32)

    def rng(self, name: str) -> np.random.Generator:
        # PCG64DXSM: the fastest of numpy's generators at raw bytes, which big presets consume.
        return np.random.Generator(np.random.PCG64DXSM([self.seed, zlib.crc32(name.encode())]))

    @staticmethod
    def std(name: str, shape: tuple[int, ...]) -> float:
        if name == "token_embd.weight":
            return 1.0
        return float(1.0 / np.sqrt(shape[-1]))  # N(0, 1/in): over inputs, or over conv taps

    def values(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        rng = self.rng(name)
        if name.endswith("norm.weight"):  # GGUF stores 1 + w: plain multipliers near 1
            return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith("ssm_a"):  # -exp(A_log), A_log ~ log U(1, 16)
            return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
        if name.endswith("ssm_dt.bias"):
            return (0.1 * rng.standard_normal(shape)).astype(np.float32)
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(self.std(name, shape))
        if self.router_skew > 0 and name == "token_embd.weight":
            # A component shared by every token, which the router's bias rides on.
            x += np.float32(0.5 * np.sqrt(self.cfg.hidden)) * self.direction
        if self.router_skew > 0 and name.endswith("ffn_gate_inp.weight"):
            # Zipf-like preference: expert of rank r gets logit bias -skew * log(1 + r).
            rank = rng.permutation(shape[0])
            bias = -self.router_skew * np.log1p(rank).astype(np.float32)
            x += (bias / np.float32(0.4 * np.sqrt(self.cfg.hidden)))[:, None] * self.direction[None, :]
        return x

    def producer(self, name: str, shape: tuple[int, ...], qtype: Q, fast: bool) -> Callable[[], np.ndarray]:
        computed = (qtype == Q.F32 or not fast or (self.router_skew > 0 and name == "token_embd.weight"))
        if computed:
            return lambda: self.values(name, shape)
        return lambda: quants.random_quantized(shape, qtype, self.rng(name), self.std(name, shape))


def make_model(path: str | Path, preset: str = "tiny", *, n_layers: int | None = None,
               n_expert: int | None = None, quant: str | Q = "f32", expert_quant: str | Q | None = None,
               seed: int = 0, fused_experts: bool = False, router_skew: float = 0.0, mtp: bool = False,
               progress: Callable[[int, int], None] | None = None, vocab_path: str | Path | None = None) -> Path:
    """Write a random-weight qwen35moe GGUF of ``preset``'s shapes to ``path`` and return it.

    ``quant`` applies to 2-D/3-D weights, ``expert_quant`` overrides it for expert tensors.
    ``router_skew`` > 0 makes routing prefer some experts (Zipf-like in expert rank).
    ``mtp`` appends one MTP block as llama.cpp loads it. Large presets write random quant
    codes directly, so writing runs at disk speed; ``progress(done, total)`` reports bytes.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r} (choose from {', '.join(PRESETS)})")
    if router_skew < 0:
        raise ConfigError(f"router_skew must be at least 0, got {router_skew}")
    qtype = parse_quant(quant)
    expert_qtype = parse_quant(expert_quant) if expert_quant is not None else None
    preset_config(preset, vocab=1, n_layers=n_layers, n_expert=n_expert, mtp=mtp)  # fail before the vocabulary is read
    vocab_file = Path(vocab_path) if vocab_path is not None else default_vocab_path()
    tiny = preset == "tiny"
    tok = tokenizer_metadata(vocab_file, n_ordinary=TINY_ORDINARY_TOKENS if tiny else None,
                             pad_to=None if tiny else REAL_VOCAB)
    cfg = preset_config(preset, vocab=len(tok[Keys.Tokenizer.LIST]), n_layers=n_layers, n_expert=n_expert,
                        mtp=mtp)

    shapes = expected_tensors(cfg, fused_experts=fused_experts)
    if mtp:
        shapes |= mtp_tensors(cfg)
    metadata: dict[str, Any] = {
        Keys.General.ARCHITECTURE: ARCH,
        Keys.General.NAME: f"random {preset} (seed {seed})",
        Keys.General.FILE_TYPE: int(_FILE_TYPES[qtype]),
        Keys.General.QUANTIZATION_VERSION: GGML_QUANT_VERSION,
    }
    metadata |= cfg.to_metadata()
    metadata |= tok
    weights = _Weights(cfg, seed, router_skew)
    specs = []
    for name, shape in shapes.items():
        t = tensor_qtype(name, shape, qtype, expert_qtype)
        specs.append(TensorSpec(name, shape, t, weights.producer(name, shape, t, fast=not tiny)))
    return write_gguf(path, metadata, specs, progress=progress)
