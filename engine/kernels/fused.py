"""The switch over the fused decode kernels (the Gated DeltaNet prologue, the MoE gate kernels,
the residual add + RMSNorm, the attention norm + RoPE), their fallback, the device check every
Triton kernel wrapper of the engine makes, and the per-device scratch of the kernels that count
their programs in (``scratch``).

Where a dispatcher picks one of them by itself (CUDA, short calls), a kernel that fails to
build or launch on this machine is switched off for the rest of the process with one warning,
and that call and the later ones take the torch definition. ``LUCE_TUNE_FUSED_KERNELS=0``
switches them all off from the start. A dispatcher told to use a kernel (its module's
``FUSED_*`` flag set to True, as the tests do) lets the error through instead.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any, Callable, TypeVar

import torch

ENV = "LUCE_TUNE_FUSED_KERNELS"
TRITON = importlib.util.find_spec("triton") is not None
_failed: dict[str, str] = {}  # kernel family -> why it was switched off
_scratch: dict[tuple[str, torch.device], torch.Tensor] = {}
T = TypeVar("T")


def allowed(name: str) -> bool:
    """Whether a dispatcher may pick the ``name`` kernels by itself."""
    return TRITON and os.environ.get(ENV, "1") != "0" and name not in _failed


def attempt(name: str, forced: bool | None, kernel: Callable[[], T]) -> T | None:
    """``kernel()``'s result. When it raises: the error itself if the caller was told to use the
    kernel (``forced``), else None, with the ``name`` kernels switched off."""
    try:
        return kernel()
    except Exception as exc:  # it did not build or launch here: it wrote nothing
        if forced:
            raise
        switch_off(name, exc)
        return None


def switch_off(name: str, exc: BaseException) -> None:
    """Record that the ``name`` kernels failed here; warn once."""
    if name not in _failed:
        _failed[name] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"the fused {name} kernel failed on this machine ({_failed[name]}); "
                      f"the torch path takes its calls from now on", RuntimeWarning, stacklevel=4)


def failures() -> dict[str, str]:
    """The kernel families switched off so far, with the reason."""
    return dict(_failed)


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The device's one ``name`` buffer, zeroed when made: the arrival counters (int32) and partial
    rows of the kernels whose last-arriving program finishes a sum (it then zeroes its counter for
    the next call, so the counters are zero between launches). Made once per device, outside any
    graph capture (a device's first call comes from a warm-up); calls on one device must not run
    concurrently on several streams."""
    key = (name, device)
    if key not in _scratch:
        with torch.inference_mode(False):
            _scratch[key] = torch.zeros(shape, dtype=dtype, device=device)
    return _scratch[key]


def check_device(x: Any, what: str) -> None:
    """A Triton kernel wrapper's tensors must be on CUDA, or on the CPU under the interpreter."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{what} needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
