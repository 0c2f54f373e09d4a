"""Export of a trained family member: HF model -> qwen35moe GGUF, then a read-back check.

The conversion itself is ``engine.gguf.convert_hf`` (llama.cpp's conventions, oracle-tested
against the engine). What is checked here is what the shipped file promises: the shape the
family preset names, the tokenizer, matrices in the asked quant type and norms in F32.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import GGUFError
from engine.gguf.names import expected_tensors
from engine.gguf.reader import GGUFFile
from engine.model.config import ModelConfig
from engine.train.family import ModelShape

# Matrices llama.cpp's converter keeps in F32 whatever the file's type.
F32_MATRICES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


@dataclass(frozen=True)
class ExportedFile:
    path: str
    bytes: int
    sha256: str
    quant: str
    tensors: int
    bytes_by_type: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_gguf(model, out_path: Path, shape: ModelShape, *, tokenizer_metadata: Mapping[str, Any],
                quant: str = "q8_0") -> ExportedFile:
    """Write ``model`` (an HF Qwen3_5MoeForCausalLM, any device) to ``out_path`` and check it back."""
    from engine.gguf.convert_hf import convert_hf

    model = model.to("cpu")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    path = Path(convert_hf(model, out_path, quant=quant, tokenizer_metadata=dict(tokenizer_metadata)))
    return check_export(path, shape, vocab=model.config.vocab_size, quant=quant)


def check_export(path: Path, shape: ModelShape, *, vocab: int, quant: str) -> ExportedFile:
    """Raise GGUFError unless ``path`` holds ``shape`` with its matrices in ``quant`` and F32 norms."""
    from engine.gguf.convert_hf import QUANTS

    matrix_type = QUANTS[quant][0]
    want = shape.model_config(vocab)
    with GGUFFile(path) as f:
        got = ModelConfig.from_metadata(f.metadata, source=str(path))
        for name in ("n_layers", "hidden", "vocab", "n_head", "n_head_kv", "head_dim", "n_expert",
                     "n_expert_used", "expert_ffn", "shared_ffn", "gdn_k_heads", "gdn_v_heads",
                     "gdn_head_k", "gdn_head_v", "full_attention_interval", "rope_dim"):
            if getattr(got, name) != getattr(want, name):
                raise GGUFError(f"{path}: {name} is {getattr(got, name)}, the {shape.name} preset has "
                                f"{getattr(want, name)}")
        if "tokenizer.ggml.tokens" not in f.metadata:
            raise GGUFError(f"{path}: metadata key 'tokenizer.ggml.tokens' is missing")
        fused = any(n.endswith("ffn_gate_up_exps.weight") for n in f.tensors)
        f.check_tensors(expected_tensors(want, fused_experts=fused))
        by_type: dict[str, int] = {}
        for name, info in f.tensors.items():
            by_type[info.qtype.name] = by_type.get(info.qtype.name, 0) + info.nbytes
            vector = len(info.shape) == 1 or name.endswith("norm.weight")
            if vector and info.qtype != GGMLQuantizationType.F32:
                raise GGUFError(f"{path}: {name!r} is {info.qtype.name}, expected F32")
            block = GGML_QUANT_SIZES[matrix_type][0]
            quantized = not vector and not name.endswith(F32_MATRICES) and info.shape[-1] % block == 0
            if quantized and info.qtype != matrix_type:
                raise GGUFError(f"{path}: matrix {name!r} is {info.qtype.name}, expected {matrix_type.name}")
        n_tensors = len(f.tensors)
    return ExportedFile(path=str(path), bytes=path.stat().st_size, sha256=sha256_of(path), quant=quant,
                        tensors=n_tensors, bytes_by_type=by_type)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
