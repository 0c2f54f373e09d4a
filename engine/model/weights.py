"""Load a qwen35moe GGUF file into per-layer weights in engine order (docs/design.md).

Engine order: torch ``[out, in]``; norms as plain multipliers (GGUF already stores ``1 + w``
for every norm but ``ssm_norm``, which HF also uses as a plain multiplier); GDN value heads
in HF/fla grouped order (GGUF stores them tiled: undone here); experts ``[E, out, in]`` with a
fused ``ffn_gate_up_exps`` split into gate and up. Vectors (norms, ``ssm_a``, ``ssm_dt``,
router, shared-expert gate) stay float32 whatever the compute dtype: ``1 + w`` rounded to
bfloat16 would lose most of ``w``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import numpy as np
import torch

from engine.gguf import names
from engine.model.config import ModelConfig
from engine.model.host_memory import mapped_view
from engine.model.value_heads import is_value_head_tensor, reorder_value_heads, to_grouped


# The token embedding is read a few rows at a time (a token's row per step, a prompt's rows per prefill),
# never as a matrix unless the output head shares it. On CUDA it then stays in pinned host memory and the
# device reads the rows it needs over the bus, as llama.cpp keeps its input embeddings in host memory:
# its bytes (1,017 MB in bf16 at the Qwen3.6-35B-A3B shapes) are left to experts. A tied embedding stays
# on the device; LUCE_TUNE_EMBED_HOST=0 keeps every embedding there.
EMBED_IN_HOST = os.environ.get("LUCE_TUNE_EMBED_HOST", "1") != "0"


def embedding_in_host(device: torch.device | str, tied: bool) -> bool:
    """Whether ``load_weights`` keeps the token embedding in pinned host memory for ``device``."""
    return EMBED_IN_HOST and torch.device(device).type == "cuda" and not tied


class TensorSource(Protocol):
    """What the loader needs of a GGUF file (``engine.gguf.reader.GGUFFile`` provides it)."""

    path: object
    metadata: Mapping[str, Any]
    tensors: Mapping[str, object]

    def load(self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor: ...

    def check_tensors(self, expected: Mapping[str, tuple[int, ...]]) -> None: ...


@dataclass(frozen=True)
class AttentionWeights:
    q: torch.Tensor  # [n_head * 2 * head_dim, hidden], per head [q | gate]
    k: torch.Tensor  # [n_head_kv * head_dim, hidden]
    v: torch.Tensor  # [n_head_kv * head_dim, hidden]
    o: torch.Tensor  # [hidden, n_head * head_dim]
    q_norm: torch.Tensor  # [head_dim] float32
    k_norm: torch.Tensor  # [head_dim] float32
    qkv: Any = None  # [q; k; v] in one matrix when they can share one (q, k, v are then its row views)


@dataclass(frozen=True)
class GDNWeights:
    qkv: torch.Tensor  # [2 * key_dim + value_dim, hidden]
    z: torch.Tensor  # [value_dim, hidden] (attn_gate)
    conv: torch.Tensor  # [conv_dim, conv_kernel]
    a: torch.Tensor  # [v_heads] float32, -exp(A_log)
    dt_bias: torch.Tensor  # [v_heads] float32
    beta: torch.Tensor  # [v_heads, hidden]
    alpha: torch.Tensor  # [v_heads, hidden]
    norm: torch.Tensor  # [head_v] float32
    out: torch.Tensor  # [hidden, value_dim]
    in_proj: Any = None  # [qkv; z; beta; alpha] in one matrix when they can share one (row views)


@dataclass
class ExpertWeights:
    """Routed experts of one layer, stacked. Mutable: a placement module may move them."""

    gate: torch.Tensor  # [n_expert, expert_ffn, hidden]
    up: torch.Tensor  # [n_expert, expert_ffn, hidden]
    down: torch.Tensor  # [n_expert, hidden, expert_ffn]

    @property
    def n_expert(self) -> int:
        return self.gate.shape[0]

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [ffn, hidden], up [ffn, hidden], down [hidden, ffn]) of expert ``e``."""
        return self.gate[e], self.up[e], self.down[e]


@dataclass(frozen=True)
class SharedExpertWeights:
    gate: torch.Tensor  # [shared_ffn, hidden]
    up: torch.Tensor  # [shared_ffn, hidden]
    down: torch.Tensor  # [hidden, shared_ffn]
    gate_inp: torch.Tensor  # [hidden] float32, sigmoid gate of the shared expert's output
    gate_up: Any = None  # [gate; up] in one matrix when they can share one (row views)


@dataclass(frozen=True)
class MoEWeights:
    router: torch.Tensor  # [n_expert, hidden] float32
    experts: ExpertWeights
    shared: SharedExpertWeights | None


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden] float32
    post_norm: torch.Tensor  # [hidden] float32
    mixer: AttentionWeights | GDNWeights
    moe: MoEWeights


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    output_norm: torch.Tensor  # [hidden] float32
    output: torch.Tensor  # [vocab, hidden] (token_embd itself when the file ties them)
    layers: tuple[LayerWeights, ...]


class RawTensorSource(TensorSource, Protocol):
    """A tensor source that also hands out a tensor's stored bytes (``GGUFFile`` does)."""

    def raw(self, name: str) -> np.ndarray: ...


@dataclass(frozen=True)
class RawExpertMatrix:
    """One stacked expert tensor of a layer as the file stores it: expert ``e`` is ``data[e]``,
    the GGUF blocks of its ``[rows, cols]`` matrix, row after row."""

    data: np.ndarray  # uint8 [n_expert, rows * row_bytes], views of the source's bytes
    qtype: Any  # gguf.GGMLQuantizationType
    rows: int
    cols: int

    def expert(self, e: int) -> np.ndarray:
        return self.data[e]


def raw_experts(source: RawTensorSource, cfg: ModelConfig) -> list[tuple[RawExpertMatrix, ...]]:
    """Per layer (gate, up, down) of the routed experts as stored, without copying or
    dequantizing (a fused ``ffn_gate_up_exps`` is split by rows)."""
    fused = has_fused_experts(source)
    shapes = names.expected_tensors(cfg, fused_experts=fused)
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        parts = ("ffn_gate_up_exps", "ffn_down_exps") if fused else ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
        wanted = {p + part + ".weight": shapes[p + part + ".weight"] for part in parts}
        source.check_tensors(wanted)
        stacks = []
        for name, (n_expert, rows, cols) in wanted.items():
            data = source.raw(name).reshape(n_expert, -1)
            stacks.append((data, source.tensors[name].qtype, rows, cols))
        if fused:
            (data, qtype, rows, cols), down = stacks
            half = data.shape[1] // 2
            stacks = [(data[:, :half], qtype, rows // 2, cols), (data[:, half:], qtype, rows // 2, cols), down]
        layers.append(tuple(RawExpertMatrix(*stack) for stack in stacks))
    return layers


def has_fused_experts(source: TensorSource) -> bool:
    return "blk.0.ffn_gate_up_exps.weight" in source.tensors


def load_weights(source: TensorSource, cfg: ModelConfig, *, device: torch.device | str,
                 dtype: torch.dtype, quantized: bool = False,
                 expert_device: torch.device | str | None = None) -> ModelWeights:
    """Check every tensor against ``cfg``, then load them one at a time onto ``device``.

    Matrices are cast to ``dtype`` as they arrive; an MTP block after ``cfg.n_layers`` is
    left unread. With ``quantized``, the projection matrices stored in a block-quantized
    type (attention, Gated DeltaNet, shared expert, output head) stay as their GGUF blocks
    (``QuantMatrix``), multiplied by the dequantize-in-register kernels; the embedding, the
    routers and the routed experts are loaded dense as before.
    ``expert_device`` puts the routed experts elsewhere than ``device``: ``"cpu"`` for a hybrid
    placement that will keep most of them in host memory (so they never pass through the GPU),
    ``"meta"`` when they are not read at all (a placement that builds them from the file).
    On CUDA an untied token embedding is kept in pinned host memory, read in place (``EMBED_IN_HOST``).
    """
    fused = has_fused_experts(source)
    expected = names.expected_tensors(cfg, fused_experts=fused)
    tied = "output.weight" not in source.tensors
    if tied:
        del expected["output.weight"]
    source.check_tensors(expected)

    def matrix(name: str) -> torch.Tensor:
        return source.load(name, dtype=dtype, device=device)

    def projection(name: str):
        kept = quant_matrix(source, name, cfg, device) if quantized else None
        return kept if kept is not None else matrix(name)

    def vector(name: str) -> torch.Tensor:
        return source.load(name, dtype=torch.float32, device=device).reshape(-1)

    expert_dev = torch.device(expert_device) if expert_device is not None else torch.device(device)

    def expert(name: str) -> torch.Tensor:
        if expert_dev.type == "meta":
            return torch.empty(expected[name], dtype=dtype, device="meta")
        return source.load(name, dtype=dtype, device=expert_dev)

    def gdn(name: str, *, keep_float32: bool = False):
        if quantized and not keep_float32:
            kept = quant_matrix(source, name, cfg, device)
            if kept is not None:
                return kept
        t = reorder_value_heads(name, source.load(name, dtype=torch.float32, device=device), cfg, to="grouped")
        return t if keep_float32 else t.to(dtype)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        if cfg.is_attention(i):
            qkv, (q, k, v) = merge_rows([projection(p + f"attn_{n}.weight") for n in "qkv"])
            mixer: AttentionWeights | GDNWeights = AttentionWeights(
                q=q, k=k, v=v, o=projection(p + "attn_output.weight"),
                q_norm=vector(p + "attn_q_norm.weight"), k_norm=vector(p + "attn_k_norm.weight"), qkv=qkv)
        else:
            in_proj, (qkv, z, beta, alpha) = merge_rows(
                [gdn(p + n) for n in ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")])
            mixer = GDNWeights(
                qkv=qkv, z=z, conv=gdn(p + "ssm_conv1d.weight"),
                a=gdn(p + "ssm_a", keep_float32=True), dt_bias=gdn(p + "ssm_dt.bias", keep_float32=True),
                beta=beta, alpha=alpha, norm=vector(p + "ssm_norm.weight"), out=gdn(p + "ssm_out.weight"),
                in_proj=in_proj)
        if fused:
            gate_up = expert(p + "ffn_gate_up_exps.weight")
            gate = gate_up[:, :cfg.expert_ffn].contiguous()
            up = gate_up[:, cfg.expert_ffn:].contiguous()
            del gate_up
        else:
            gate, up = expert(p + "ffn_gate_exps.weight"), expert(p + "ffn_up_exps.weight")
        experts = ExpertWeights(gate=gate, up=up, down=expert(p + "ffn_down_exps.weight"))
        shared = None
        if cfg.shared_ffn:
            gate_up, (gate_s, up_s) = merge_rows([projection(p + "ffn_gate_shexp.weight"),
                                                  projection(p + "ffn_up_shexp.weight")])
            shared = SharedExpertWeights(
                gate=gate_s, up=up_s, down=projection(p + "ffn_down_shexp.weight"),
                gate_inp=vector(p + "ffn_gate_inp_shexp.weight"), gate_up=gate_up)
        moe = MoEWeights(router=source.load(p + "ffn_gate_inp.weight", dtype=torch.float32, device=device),
                         experts=experts, shared=shared)
        layers.append(LayerWeights(attn_norm=vector(p + "attn_norm.weight"),
                                   post_norm=vector(p + "post_attention_norm.weight"), mixer=mixer, moe=moe))

    if embedding_in_host(device, tied):
        embed = mapped_view(source.load("token_embd.weight", dtype=dtype, device="cpu").pin_memory(),
                            torch.device(device))
    else:
        embed = matrix("token_embd.weight")
    return ModelWeights(embed=embed, output_norm=vector("output_norm.weight"),
                        output=embed if tied else projection("output.weight"), layers=tuple(layers))


def merge_rows(parts: list) -> tuple[Any, list]:
    """``parts`` (matrices of one input width, each multiplied by the same input) stacked into one
    matrix, and the parts again as row views of it: one matrix product then serves them all.
    Dense parts need one dtype and device, quantized ones (``QuantMatrix``) one type and device.
    Returns (None, ``parts``) when they cannot share a matrix."""
    from engine.kernels.quant import QuantMatrix

    first = parts[0]
    if all(isinstance(p, torch.Tensor) and p.dim() == 2 for p in parts):
        if any((p.dtype, p.device, p.shape[1]) != (first.dtype, first.device, first.shape[1]) for p in parts):
            return None, parts
        merged = torch.cat(parts)
        return merged, list(merged.split([p.shape[0] for p in parts]))
    if all(isinstance(p, QuantMatrix) for p in parts):
        if any((p.qtype, p.k, p.device, p.layout) != (first.qtype, first.k, first.device, first.layout)
               for p in parts):
            return None, parts
        raw = torch.cat([p.raw for p in parts])
        merged = QuantMatrix(raw, first.qtype, raw.shape[0], first.k, first.layout)
        views, start = [], 0
        for p in parts:
            views.append(QuantMatrix(raw[start:start + p.n], p.qtype, p.n, p.k, p.layout))
            start += p.n
        return merged, views
    return None, parts


def quant_matrix(source: TensorSource, name: str, cfg: ModelConfig, device: torch.device | str):
    """``name`` as a ``QuantMatrix`` on ``device`` (GDN value heads in engine order), or None when
    it is not stored block-quantized or its value heads cannot be reordered block-wise. On CUDA,
    Q4_0 and Q8_0 rows take the split layout the decode kernels load as vectors."""
    from gguf import GGML_QUANT_SIZES

    from engine.kernels.quant import QTYPES, QuantMatrix
    from engine.kernels.quant.reference import SPLIT_QTYPES, split_layout_on

    info = source.tensors[name]
    if info.qtype not in QTYPES or len(info.shape) != 2:
        return None
    n, k = (int(d) for d in info.shape)
    raw = torch.from_numpy(np.array(source.raw(name))).view(n, -1)  # a private copy of the mapped bytes
    if is_value_head_tensor(name) and cfg.gdn_k_heads != cfg.gdn_v_heads:
        if name.endswith(".ssm_out.weight"):  # value heads along the row: whole blocks must move together
            block, block_bytes = GGML_QUANT_SIZES[info.qtype]
            if cfg.gdn_head_v % block:
                return None
            blocks = raw.view(n, k // block, block_bytes)
            raw = to_grouped(blocks, 1, cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_head_v // block).reshape(n, -1)
        else:  # value heads along the rows: the permutation moves whole rows of blocks
            raw = reorder_value_heads(name, raw, cfg, to="grouped")
    qm = QuantMatrix.from_gguf_bytes(raw.contiguous(), info.qtype, n, k).to(device)
    return qm.with_layout("split") if split_layout_on(qm.device) and qm.qtype in SPLIT_QTYPES else qm
