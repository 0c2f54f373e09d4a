"""luce-tune's inference engine for qwen35moe GGUF models.

``engine.Engine`` and ``engine.Tokenizer`` are imported on first use, so that importing a
light module (``engine.errors``) does not pull in torch.
"""

from typing import Any

__all__ = ["Engine", "Generation", "Timings", "Tokenizer"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "Generation", "Timings"):
        from engine import engine as _engine

        return getattr(_engine, name)
    if name == "Tokenizer":
        from engine.tokenizer import Tokenizer

        return Tokenizer
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
