"""The qwen35moe model: config, weights, layers, state, and ``Qwen35MoE`` which assembles them.

Names are imported on first use, so that reading a ``ModelConfig`` does not pull in torch.
"""

from typing import Any

__all__ = ["ForwardOutput", "ModelConfig", "ModelState", "Qwen35MoE"]


def __getattr__(name: str) -> Any:
    if name == "ModelConfig":
        from engine.model.config import ModelConfig

        return ModelConfig
    if name == "ModelState":
        from engine.model.state import ModelState

        return ModelState
    if name in ("ForwardOutput", "Qwen35MoE"):
        from engine.model import qwen35moe

        return getattr(qwen35moe, name)
    raise AttributeError(f"module 'engine.model' has no attribute {name!r}")
