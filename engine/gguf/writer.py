"""write_gguf(): a streaming, atomic GGUF v3 writer.

Tensor data is produced and written one tensor at a time, so a model far larger than memory
can be written. The file appears under its name only once it is complete.
"""

from __future__ import annotations

import os
import struct
from types import MappingProxyType
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from gguf import (GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, GGMLQuantizationType, GGUFValue,
                  GGUFValueType, Keys)

from engine.gguf import quants

V = GGUFValueType


def _key_types() -> dict[str, tuple[GGUFValueType, GGUFValueType | None]]:
    """Types of the standard keys, as gguf-py's GGUFWriter helpers (``add_*``) write them."""
    u32 = (V.UINT32, None)
    f32 = (V.FLOAT32, None)
    boolean = (V.BOOL, None)
    general = Keys.General
    llm, att, rope, ssm, tok = Keys.LLM, Keys.Attention, Keys.Rope, Keys.SSM, Keys.Tokenizer
    types = {
        general.QUANTIZATION_VERSION: u32, general.ALIGNMENT: u32, general.FILE_TYPE: u32,
        tok.BOS_ID: u32, tok.EOS_ID: u32, tok.EOT_ID: u32, tok.EOM_ID: u32, tok.UNK_ID: u32,
        tok.SEP_ID: u32, tok.PAD_ID: u32, tok.MASK_ID: u32, tok.TOKEN_TYPE_COUNT: u32,
        tok.FIM_PRE_ID: u32, tok.FIM_SUF_ID: u32, tok.FIM_MID_ID: u32, tok.FIM_PAD_ID: u32,
        tok.FIM_REP_ID: u32, tok.FIM_SEP_ID: u32,
        tok.ADD_BOS: boolean, tok.ADD_EOS: boolean, tok.ADD_SEP: boolean, tok.ADD_PREFIX: boolean,
        tok.LIST: (V.ARRAY, V.STRING), tok.MERGES: (V.ARRAY, V.STRING),
        tok.TOKEN_TYPE: (V.ARRAY, V.INT32), tok.SCORES: (V.ARRAY, V.FLOAT32),
    }
    per_arch = {
        llm.VOCAB_SIZE: u32, llm.CONTEXT_LENGTH: u32, llm.EMBEDDING_LENGTH: u32, llm.BLOCK_COUNT: u32,
        llm.FEED_FORWARD_LENGTH: u32, llm.EXPERT_FEED_FORWARD_LENGTH: u32,
        llm.EXPERT_SHARED_FEED_FORWARD_LENGTH: u32, llm.EXPERT_COUNT: u32, llm.EXPERT_USED_COUNT: u32,
        llm.EXPERT_SHARED_COUNT: u32, llm.LEADING_DENSE_BLOCK_COUNT: u32,
        llm.FULL_ATTENTION_INTERVAL: u32, llm.NEXTN_PREDICT_LAYERS: u32,
        llm.EXPERT_WEIGHTS_SCALE: f32, llm.EXPERT_WEIGHTS_NORM: boolean, llm.EXPERT_GATING_FUNC: u32,
        att.HEAD_COUNT: u32, att.HEAD_COUNT_KV: u32, att.KEY_LENGTH: u32, att.VALUE_LENGTH: u32,
        att.LAYERNORM_EPS: f32, att.LAYERNORM_RMS_EPS: f32, att.SLIDING_WINDOW: u32,
        rope.DIMENSION_COUNT: u32, rope.FREQ_BASE: f32, rope.SCALING_FACTOR: f32,
        rope.SCALING_ORIG_CTX_LEN: u32, rope.DIMENSION_SECTIONS: (V.ARRAY, V.INT32),
        ssm.CONV_KERNEL: u32, ssm.INNER_SIZE: u32, ssm.STATE_SIZE: u32, ssm.TIME_STEP_RANK: u32,
        ssm.GROUP_COUNT: u32,
    }
    return types | {key.replace("{arch}.", "", 1): t for key, t in per_arch.items()}


_STANDARD = MappingProxyType(_key_types())
_PACK = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
         V.FLOAT32: "f", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d", V.BOOL: "?"}
_NUMPY_TYPES = {np.dtype(np.uint8): V.UINT8, np.dtype(np.int8): V.INT8, np.dtype(np.uint16): V.UINT16,
                np.dtype(np.int16): V.INT16, np.dtype(np.uint32): V.UINT32, np.dtype(np.int32): V.INT32,
                np.dtype(np.float32): V.FLOAT32, np.dtype(np.uint64): V.UINT64, np.dtype(np.int64): V.INT64,
                np.dtype(np.float64): V.FLOAT64, np.dtype(np.bool_): V.BOOL}


def standard_type(key: str) -> tuple[GGUFValueType, GGUFValueType | None] | None:
    """The (type, array element type) llama.cpp expects for a standard key, if it is one."""
    if key in _STANDARD:
        return _STANDARD[key]
    _, _, rest = key.partition(".")
    return _STANDARD.get(rest) if not key.startswith(("general.", "tokenizer.")) else None


def _default_type(value: Any) -> GGUFValueType:
    if isinstance(value, (bool, np.bool_)):
        return V.BOOL
    if isinstance(value, (str, bytes)):
        return V.STRING
    if isinstance(value, np.generic):
        return _NUMPY_TYPES[value.dtype]
    if isinstance(value, int):
        return V.UINT32 if 0 <= value < 2**32 else V.INT32 if -2**31 <= value < 0 else V.INT64
    if isinstance(value, float):
        return V.FLOAT32
    if isinstance(value, (list, tuple, np.ndarray)):
        return V.ARRAY
    raise TypeError(f"no GGUF type for a value of type {type(value).__name__}")


def _element_type(values: Sequence[Any]) -> GGUFValueType:
    if isinstance(values, np.ndarray) and values.dtype in _NUMPY_TYPES:
        return _NUMPY_TYPES[values.dtype]
    if len(values) == 0:
        raise ValueError("an empty array has no GGUF element type")
    first = values[0]
    if isinstance(first, (bool, np.bool_)):
        return V.BOOL
    if isinstance(first, (str, bytes)):
        return V.STRING
    if isinstance(first, float):
        return V.FLOAT32
    if isinstance(first, int):
        return V.INT32  # as gguf's GGUFValueType.get_type, used by GGUFWriter.add_array
    return _default_type(first)


def _pack_value(value: Any, vtype: GGUFValueType, etype: GGUFValueType | None) -> bytes:
    if vtype in _PACK:
        return struct.pack("<" + _PACK[vtype], value)
    if vtype == V.STRING:
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(data)) + data
    if vtype == V.ARRAY:
        etype = etype if etype is not None else _element_type(value)
        head = struct.pack("<IQ", etype, len(value))
        if etype in _PACK:
            dtype = next(d for d, t in _NUMPY_TYPES.items() if t == etype).newbyteorder("<")
            return head + np.asarray(value, dtype=dtype).tobytes()
        return head + b"".join(_pack_value(v, etype, None) for v in value)
    raise ValueError(f"cannot write a value of GGUF type {vtype.name}")


def encode_kv(key: str, value: Any) -> bytes:
    """One key/value pair in GGUF encoding; standard keys get llama.cpp's types.

    A ``gguf.GGUFValue`` forces a type; other keys take a type from the Python value
    (non-negative int -> uint32, float -> float32, list of int -> int32 array).
    """
    if isinstance(value, GGUFValue):
        vtype, etype, value = value.type, value.sub_type, value.value
    else:
        vtype, etype = standard_type(key) or (_default_type(value), None)
    if isinstance(value, tuple):
        value = list(value)
    try:
        body = _pack_value(value, vtype, etype)
    except (struct.error, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"metadata key {key!r}: value {_short(value)} cannot be written as "
                         f"{vtype.name}{'' if etype is None else ' of ' + etype.name} ({exc})") from None
    return _pack_value(key, V.STRING, None) + struct.pack("<I", vtype) + body


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write. ``producer`` returns its data when it is its turn: either raw
    uint8 bytes already in ``qtype``'s layout, or float values quantized on the way out."""

    name: str
    shape: tuple[int, ...]  # torch order
    qtype: GGMLQuantizationType
    producer: Callable[[], np.ndarray]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "qtype", GGMLQuantizationType(self.qtype))
        if not self.name or len(self.name.encode("utf-8")) >= 64:
            raise ValueError(f"tensor name {self.name!r} must be 1 to 63 bytes (GGML_MAX_NAME)")
        if not 1 <= len(self.shape) <= 4:
            raise ValueError(f"tensor {self.name!r} has {len(self.shape)} dimensions, expected 1 to 4")
        try:
            quants.tensor_nbytes(self.qtype, self.shape)
        except ValueError as exc:
            raise ValueError(f"tensor {self.name!r}: {exc}") from None

    @property
    def nbytes(self) -> int:
        return quants.tensor_nbytes(self.qtype, self.shape)

    def data(self) -> np.ndarray:
        """Call the producer and return the tensor's bytes, checked against its size."""
        values = np.asarray(self.producer())
        if values.dtype == np.uint8:
            data = np.ascontiguousarray(values).reshape(-1)
        elif values.dtype.kind == "f":
            if values.size != int(np.prod(self.shape)):
                raise ValueError(f"tensor {self.name!r}: producer returned {values.size} values, "
                                 f"expected {int(np.prod(self.shape))} for shape {self.shape}")
            data = quants.quantize(values.reshape(self.shape), self.qtype)
        else:
            raise ValueError(f"tensor {self.name!r}: producer returned {values.dtype} data, "
                             "expected uint8 bytes or float values")
        if data.size != self.nbytes:
            raise ValueError(f"tensor {self.name!r}: producer returned {data.size} bytes, expected "
                             f"{self.nbytes} for {self.qtype.name} {self.shape}")
        return data


def _pad(n: int, alignment: int) -> int:
    return -n % alignment


def write_gguf(path: str | Path, metadata: Mapping[str, Any], tensors: Iterable[TensorSpec | tuple],
               *, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a GGUF v3 file: header, key/values, tensor index, then each tensor's data in turn.

    ``metadata`` must hold ``general.architecture``; ``progress(done, total)`` is called with
    tensor bytes after each tensor. The file is written beside ``path`` under a temporary name,
    flushed to disk and renamed, so ``path`` is either untouched or complete.
    """
    path = Path(path)
    specs = [t if isinstance(t, TensorSpec) else TensorSpec(*t) for t in tensors]
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r} is given twice")
        seen.add(spec.name)
    if Keys.General.ARCHITECTURE not in metadata:
        raise ValueError(f"metadata must contain {Keys.General.ARCHITECTURE!r}")
    alignment = metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if isinstance(alignment, GGUFValue):
        alignment = alignment.value
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")

    header = bytearray(struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(specs), len(metadata)))
    for key, value in metadata.items():
        header += encode_kv(key, value)
    offset = 0
    for spec in specs:
        header += _pack_value(spec.name, V.STRING, None)
        header += struct.pack(f"<I{len(spec.shape)}QIQ", len(spec.shape), *reversed(spec.shape),
                              spec.qtype, offset)
        offset += spec.nbytes + _pad(spec.nbytes, alignment)
    header += bytes(_pad(len(header), alignment))
    total = sum(spec.nbytes for spec in specs)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # mode as umask allows
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(header)
            done = 0
            for spec in specs:
                data = spec.data()
                fh.write(memoryview(data))
                fh.write(bytes(_pad(data.size, alignment)))
                done += data.size
                if progress is not None:
                    progress(done, total)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
