"""What a GGUF file holds, for ``luce-tune inspect``: a plain summary and its rich rendering."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import Keys
from rich.console import Group
from rich.table import Table

from engine.gguf.reader import GGUFFile


def summarize(path: str | Path) -> dict[str, Any]:
    """Architecture, hyperparameters, tensors by quant type, tokenizer and MTP presence."""
    with GGUFFile(path) as f:
        arch = f.architecture
        prefix = f"{arch}."
        hyper = {k[len(prefix):]: v for k, v in f.metadata.items() if k.startswith(prefix)}
        by_type: dict[str, dict[str, int]] = {}
        for info in f.tensors.values():
            entry = by_type.setdefault(info.qtype.name, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += info.nbytes
        tokens = f.metadata.get(Keys.Tokenizer.LIST)
        nextn = int(hyper.get("nextn_predict_layers", 0) or 0)
        return {
            "path": str(f.path),
            "file_bytes": f.path.stat().st_size,
            "version": f.version,
            "architecture": arch,
            "name": f.metadata.get(Keys.General.NAME),
            "hyperparameters": hyper,
            "tensor_count": len(f.tensors),
            "tensor_bytes": sum(e["bytes"] for e in by_type.values()),
            "by_type": dict(sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"])),
            "vocab_size": len(tokens) if tokens is not None else None,
            "tokenizer_model": f.metadata.get(Keys.Tokenizer.MODEL),
            "tokenizer_pre": f.metadata.get(Keys.Tokenizer.PRE),
            "mtp": nextn > 0 or any(".nextn." in name for name in f.tensors),
            "mtp_layers": nextn,
        }


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _value(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v[:8])) + (", ..." if len(v) > 8 else "") + "]"
    return str(v)


def render(summary: dict[str, Any]) -> Group:
    """A rich renderable of ``summarize``'s output."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("file", f"{summary['path']} ({_size(summary['file_bytes'])}, GGUF v{summary['version']})")
    head.add_row("architecture", str(summary["architecture"]))
    if summary.get("name"):
        head.add_row("name", str(summary["name"]))
    tok = summary["tokenizer_model"] or "none"
    if summary["tokenizer_pre"]:
        tok += f" / {summary['tokenizer_pre']}"
    vocab = summary["vocab_size"]
    head.add_row("tokenizer", f"{tok}, {vocab if vocab is not None else 'no'} tokens")
    head.add_row("MTP", f"yes ({summary['mtp_layers']} layer)" if summary["mtp"] else "no")
    head.add_row("tensors", f"{summary['tensor_count']} ({_size(summary['tensor_bytes'])})")

    hyper = Table(title="hyperparameters", title_justify="left", show_header=False, box=None)
    hyper.add_column(style="cyan")
    hyper.add_column()
    for key, value in summary["hyperparameters"].items():
        hyper.add_row(key, _value(value))

    types = Table(title="tensors by type", title_justify="left")
    types.add_column("type")
    types.add_column("count", justify="right")
    types.add_column("size", justify="right")
    for name, entry in summary["by_type"].items():
        types.add_row(name, str(entry["count"]), _size(entry["bytes"]))
    parts: list[Any] = [head]
    if summary["hyperparameters"]:
        parts.append(hyper)
    if summary["by_type"]:
        parts.append(types)
    return Group(*parts)
