"""GGUFFile: a validated, memory-mapped view of a GGUF file's metadata and tensor index.

The header is parsed here rather than through ``gguf.GGUFReader``: that reader builds numpy
views for every element of every metadata array, which takes over ten seconds on a
250K-token vocabulary, while opening a file must be quick enough to validate interactively.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, Keys

from engine.errors import GGUFError
from engine.gguf import quants

SUPPORTED_VERSIONS = (2, 3)
HEADER_BYTES = 24  # magic, version, tensor count, key/value count
MAX_DIMS = 4
# Raw bytes dequantized at a time by ``load``: cache-sized on the CPU, larger on accelerators.
_CPU_CHUNK_BYTES = 1 << 22
_DEVICE_CHUNK_BYTES = 1 << 26

_U64 = struct.Struct("<Q")
_SCALAR = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8", GGUFValueType.BOOL: "?",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: GGUF ne reversed
    qtype: GGMLQuantizationType
    nbytes: int
    offset: int  # absolute byte offset of the data in the file

    def __post_init__(self) -> None:
        if not self.shape or any(d <= 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r} has a non-positive dimension in {self.shape}")
        if self.nbytes != quants.tensor_nbytes(self.qtype, self.shape):
            raise ValueError(f"tensor {self.name!r}: {self.nbytes} bytes do not match "
                             f"{self.qtype.name} {self.shape}")


class _Truncated(Exception):
    """Raised by the cursor when a field runs past the end of the file."""


class _Cursor:
    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated(self.pos)

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize("<" + fmt)
        self._need(n)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def raw_string(self) -> bytes:
        n = self.scalar("Q")
        self._need(n)
        value = self.buf[self.pos:self.pos + n]
        self.pos += n
        return value

    def string(self) -> str:
        return self.raw_string().decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """``count`` length-prefixed strings, decoded in one go (250K-token vocabularies).

        One Python pass finds the 8-byte length fields; numpy turns each into a NUL separator;
        a single decode and split yields the strings. Strings holding NUL take the slow path.
        """
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        start, heads = pos, []
        append = heads.append
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated(pos)
            append(pos)
            pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            raise _Truncated(heads[-1])
        self.pos = pos
        if count == 0:
            return []
        region = np.frombuffer(buf, dtype=np.uint8, count=pos - start, offset=start).copy()
        rel = np.asarray(heads, dtype=np.int64) - start
        region[rel + 7] = 0
        keep = np.ones(region.size, dtype=bool)
        keep[(rel[:, None] + np.arange(7)).reshape(-1)] = False
        parts = region[keep].tobytes().decode("utf-8").split("\0")
        if len(parts) == count + 1:
            return parts[1:]
        return [bytes(buf[h + 8:h + 8 + unpack(buf, h)[0]]).decode("utf-8") for h in heads]

    def array(self, count: int, dtype: str) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        self._need(count * itemsize)
        value = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * itemsize
        return value


def _read_value(cur: _Cursor, vtype: GGUFValueType) -> tuple[Any, GGUFValueType | None]:
    """One metadata value as a plain Python value, and the element type of an array."""
    if vtype == GGUFValueType.FLOAT32:
        # The shortest decimal that is the same float32: 1e-06 rather than 9.99999997e-07.
        return float(str(np.float32(cur.scalar("f")))), None
    if vtype in _SCALAR:
        return cur.scalar(_SCALAR[vtype]), None
    if vtype == GGUFValueType.STRING:
        return cur.string(), None
    if vtype == GGUFValueType.ARRAY:
        etype = GGUFValueType(cur.scalar("I"))
        count = cur.scalar("Q")
        if etype == GGUFValueType.STRING:
            return cur.strings(count), etype
        if etype in _NUMPY:
            return cur.array(count, _NUMPY[etype]).tolist(), etype
        return [_read_value(cur, etype)[0] for _ in range(count)], etype
    raise ValueError(f"unknown value type {vtype}")


class GGUFFile:
    """A GGUF file opened for reading: ``metadata``, ``tensors`` and per-tensor loads.

    Opening validates the whole header and every tensor's data range, so a bad file fails
    here with one sentence rather than halfway through loading a model.
    """

    def __init__(self, path: str | Path, *, architecture: str | None = None) -> None:
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        self._buf: np.ndarray | None = None
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: file not found") from None
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot be read ({exc.strerror})") from None
        if size < HEADER_BYTES:
            raise GGUFError(f"{self.path}: file is {size} bytes, shorter than a GGUF header "
                            f"({HEADER_BYTES} bytes)")
        try:
            with open(self.path, "rb") as fh:
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot be mapped ({exc.strerror})") from None
        try:
            self._parse(size)
        except BaseException:
            self.close()
            raise
        if architecture is not None and self.architecture != architecture:
            self.close()
            raise GGUFError(f"{self.path}: architecture is {self.architecture!r}, expected {architecture!r}")

    def _parse(self, size: int) -> None:
        cur = _Cursor(self._mm, size)
        magic = bytes(self._mm[0:4])
        if struct.unpack("<I", magic)[0] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
        cur.pos = 4
        self.version = cur.scalar("I")
        if self.version & 0xFFFF == 0 and self.version:
            raise GGUFError(f"{self.path}: file is a big-endian GGUF, which is not supported")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported "
                            f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        key, where = None, "in the key/value count"
        try:
            for _ in range(n_kv):
                key, where = None, "in a metadata key name"
                key = cur.string()
                where = f"in metadata key {key!r}"
                if key in self.metadata:
                    raise GGUFError(f"{self.path}: metadata key {key!r} appears twice")
                vtype = GGUFValueType(cur.scalar("I"))
                self.metadata[key], etype = _read_value(cur, vtype)
                self.metadata_types[key] = (vtype, etype)
            where = "in the tensor index"
            infos = [self._tensor_header(cur) for _ in range(n_tensors)]
        except _Truncated as exc:
            raise GGUFError(f"{self.path}: file is cut short {where} at byte {exc.args[0]} "
                            f"(file is {size} bytes)") from None
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: a string {where} is not valid UTF-8") from None
        except ValueError as exc:  # an unknown value type id
            raise GGUFError(f"{self.path}: invalid value type {where} ({exc})") from None

        alignment = self.metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment is {alignment!r}, expected a power of two")
        self.alignment = alignment
        self.data_offset = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, rel in infos:
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} appears twice")
            if rel % alignment:
                raise GGUFError(f"{self.path}: tensor {name!r} data offset {rel} is not aligned to {alignment}")
            try:
                nbytes = quants.tensor_nbytes(qtype, shape)
            except ValueError as exc:
                raise GGUFError(f"{self.path}: tensor {name!r} of shape {shape}: {exc}") from None
            start = self.data_offset + rel
            if start + nbytes > size:
                raise GGUFError(f"{self.path}: tensor {name!r} data ends at byte {start + nbytes}, beyond "
                                f"the end of the file ({size} bytes): the file is truncated")
            self.tensors[name] = TensorInfo(name, shape, qtype, nbytes, start)
        arch = self.metadata.get(Keys.General.ARCHITECTURE)
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata key {Keys.General.ARCHITECTURE!r} is missing")
        self.architecture: str = arch
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)

    def _tensor_header(self, cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cur.raw_string().decode("utf-8", errors="replace")
        n_dims = cur.scalar("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions, expected 1 to {MAX_DIMS}")
        ne = [cur.scalar("Q") for _ in range(n_dims)]
        type_id = cur.scalar("I")
        rel = cur.scalar("Q")
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml type id {type_id}") from None
        if qtype not in quants.SUPPORTED or qtype not in GGML_QUANT_SIZES:
            supported = ", ".join(t.name for t in quants.SUPPORTED)
            raise GGUFError(f"{self.path}: tensor {name!r} has quant type {qtype.name}, which is not "
                            f"supported (supported: {supported})")
        return name, tuple(int(d) for d in reversed(ne)), qtype, rel

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # arrays from raw() still use the mapping; it closes when they are freed
            self._mm = None

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, architecture={getattr(self, 'architecture', None)!r})"

    def _info(self, name: str) -> TensorInfo:
        if self._buf is None:
            raise GGUFError(f"{self.path}: file is closed")
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: tensor {name!r} is not in the file")
        return info

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array backed by the file mapping."""
        info = self._info(name)
        return self._buf[info.offset:info.offset + info.nbytes]

    def load(self, name: str, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> torch.Tensor:
        """Dequantize one tensor into a new ``dtype`` tensor on ``device`` (shape in torch order).

        The raw bytes travel to ``device`` and are dequantized there, a slab of rows at a time,
        so peak memory is the result plus one slab.
        """
        info = self._info(name)
        out = torch.empty(info.shape, dtype=dtype, device=device)
        rows = math.prod(info.shape[:-1])
        row_bytes = info.nbytes // rows
        flat = out.reshape(rows, info.shape[-1])
        chunk = _CPU_CHUNK_BYTES if out.device.type == "cpu" else _DEVICE_CHUNK_BYTES
        step = max(1, chunk // row_bytes)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            a = info.offset + r0 * row_bytes
            raw = torch.from_numpy(self._buf[a:info.offset + r1 * row_bytes].copy()).to(out.device)
            flat[r0:r1] = quants.dequantize(raw, info.qtype, (r1 - r0, info.shape[-1]))
        return out

    def check_tensors(self, expected: Mapping[str, tuple[int, ...]], *, source: str | None = None) -> None:
        """Raise GGUFError naming the first expected tensor that is missing or has another shape."""
        where = source if source is not None else str(self.path)
        for name, shape in expected.items():
            info = self.tensors.get(name)
            if info is None:
                raise GGUFError(f"{where}: tensor {name!r} is missing (expected shape {tuple(shape)})")
            if info.shape != tuple(shape):
                raise GGUFError(f"{where}: tensor {name!r} has shape {info.shape}, expected {tuple(shape)}")
