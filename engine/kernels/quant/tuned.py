"""Decode-kernel tiles measured per weight shape on a GPU model, read by the quantized matmuls.

``bench/quant_matmul.py --sweep --write-tuned engine/kernels/quant/tuned.json`` times candidate
GEMV and routed-expert tiles at a model's shapes and writes the fastest per (kind, quant type,
N, K), with the GPU's name, its chip (compute capability and multiprocessor count), the date and
the timings it saw, as that GPU's table of the file (the other GPUs' tables stay). The kernels
use an entry on a GPU of that name, else on a GPU of the same chip (an H100 SXM reads an H200's
table: one die, 132 multiprocessors, other memory) (``config_for``); any other device, shape or a
missing or unreadable file keeps the default tiles, so a table never changes results, only speed
(tiles change the summation order within float32 accumulation, as any two tile choices do).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

TABLE = Path(__file__).with_name("tuned.json")
KINDS = ("gemv", "experts", "moe_gate_up", "moe_down")
TILE_KEYS = ("gemv_block_n", "gemv_block_k", "gemv_num_warps", "gemv_split_k")
# optional: the row kernels (``engine.kernels.quant.rows``), the experts' down launch split per pair and the
# word GEMV (``engine.kernels.quant.words``)
ROW_KEYS = ("gemv_rows_warps", "gemv_rows_unroll", "gemv_pair_split", "gemv_words")


@lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@lru_cache(maxsize=None)
def chip_of(device: torch.device) -> str | None:
    """A CUDA device's chip as tables name it, ``"sm_90/132"`` (compute capability and multiprocessor count);
    None for other devices."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return f"sm_{props.major}{props.minor}/{props.multi_processor_count}"


def read_tables(path: Path) -> list[dict[str, Any]]:
    """The tables of a tile file, one per GPU name (``{"tables": [...]}``; a file of one table at its top level, as
    they were first written, reads as that table); empty when there is no file. Raises ValueError, KeyError or
    TypeError where the file is not such a thing."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    tables = data["tables"] if isinstance(data, dict) and "tables" in data else [data]
    for t in tables:
        if not isinstance(t, dict) or not isinstance(t["device"], str) or not isinstance(t["entries"], list):
            raise TypeError(f"a tile table is an object with a device name and a list of entries, got {t!r:.80}")
    return tables


@lru_cache(maxsize=4)
def load_table(path: Path) -> dict[tuple[str, str, str, int, int], dict[str, int]]:
    """(device name, kind, quant type name, N, K) -> tile fields, for every table of the file, and the same
    entries under each table's chip (``chip_of``) in place of its name where it records one (the first table of a
    chip where several do); empty when there is no file.

    A file that does not parse is reported once and ignored (the default tiles stay)."""
    try:
        out: dict[tuple[str, str, str, int, int], dict[str, int]] = {}
        for table in read_tables(path):
            for e in table["entries"]:
                shape = (e["kind"], e["qtype"], int(e["n"]), int(e["k"]))
                tiles = {k: int(e[k]) for k in (*TILE_KEYS, *(k for k in ROW_KEYS if k in e))}
                out[(table["device"], *shape)] = tiles
                if table.get("chip"):
                    out.setdefault((str(table["chip"]), *shape), tiles)
        return out
    except (ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"{path}: not a tile table ({exc!r}); the quantized kernels keep their default tiles",
                      stacklevel=2)
        return {}


def config_for(kind: str, qtype_name: str, n: int, k: int, device: torch.device, default: Any) -> Any:
    """The measured tiles for this shape on this GPU, else on a GPU of its chip, else ``default`` (a
    ``QuantKernelConfig``)."""
    table = load_table(TABLE)
    if not table:
        return default
    entry = table.get((_device_name(device), kind, qtype_name, n, k))
    if entry is None and chip_of(device) is not None:
        entry = table.get((chip_of(device), kind, qtype_name, n, k))
    if entry is None:
        if device.type == "cuda":
            _warn_untuned(_device_name(device), chip_of(device), TABLE)
        return default
    names = {f.name for f in fields(default)}
    return type(default)(**{**{f: getattr(default, f) for f in names}, **entry})


@lru_cache(maxsize=None)
def _warn_untuned(name: str, chip: str | None, path: Path) -> None:
    """Once per GPU: say so where the file has no table for it by name or chip (the default tiles decode the 35B
    shapes at about half the speed of measured ones: docs/benchmarks.md, 2026-12-05 eleventh round)."""
    measured = {key[0] for key in load_table(path)}  # the tables' GPU names and chips
    if name not in measured and chip not in measured:
        warnings.warn(f"{path.name} has no decode tiles measured on {name} ({chip}): the quantized kernels use their "
                      f"default tiles; `python bench/quant_matmul.py --sweep --write-tuned {path}` measures this "
                      "GPU's", stacklevel=3)


def write_table(path: Path, device_name: str, entries: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write ``device_name``'s table atomically (temporary file, then rename), keeping the other GPUs' tables of the
    file; ``entries`` carry kind, qtype, n, k, the tile fields and whatever measurements the caller keeps with them;
    ``meta`` may name the GPU's chip (``"chip": chip_of(device)``), whose other GPUs then read the table too. A file
    there that is not a tile table is left alone: ValueError names it."""
    for e in entries:
        missing = [k for k in ("kind", "qtype", "n", "k", *TILE_KEYS) if k not in e]
        if missing or e["kind"] not in KINDS:
            raise ValueError(f"tile entry {e} lacks {missing} or has an unknown kind")
    try:
        others = [t for t in read_tables(path) if t["device"] != device_name]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a tile table ({exc!r}); not overwritten: move it away first") from None
    tmp = path.with_suffix(".tmp")
    table = {"device": device_name, **meta, "entries": entries}
    tmp.write_text(json.dumps({"tables": [*others, table]}, indent=1) + "\n")
    tmp.replace(path)
    load_table.cache_clear()
    _warn_untuned.cache_clear()
