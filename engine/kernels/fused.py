"""The switch over the fused decode kernels (the Gated DeltaNet prologue, the MoE gate kernels,
the residual add + RMSNorm), and their fallback.

Where a dispatcher picks one of them by itself (CUDA, short calls), a kernel that fails to
build or launch on this machine is switched off for the rest of the process with one warning,
and that call and the later ones take the torch definition. ``LUCE_TUNE_FUSED_KERNELS=0``
switches them all off from the start. A dispatcher told to use a kernel (its module's
``FUSED_*`` flag set to True, as the tests do) lets the error through instead.
"""

from __future__ import annotations

import os
import warnings

ENV = "LUCE_TUNE_FUSED_KERNELS"
_failed: dict[str, str] = {}  # kernel family -> why it was switched off


def allowed(name: str) -> bool:
    """Whether a dispatcher may pick the ``name`` kernels by itself."""
    return os.environ.get(ENV, "1") != "0" and name not in _failed


def switch_off(name: str, exc: BaseException) -> None:
    """Record that the ``name`` kernels failed here; warn once."""
    if name not in _failed:
        _failed[name] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"the fused {name} kernel failed on this machine ({_failed[name]}); "
                      f"the torch path takes its calls from now on", RuntimeWarning, stacklevel=3)


def failures() -> dict[str, str]:
    """The kernel families switched off so far, with the reason."""
    return dict(_failed)
