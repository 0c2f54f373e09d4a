"""Programmatic dependent launch (Hopper and later) for the decode step's Triton kernels.

A decode step is a chain of several hundred short kernels, and each one waits for the one
before it to finish, then for its own launch and its programs' scheduling: a few microseconds
per kernel during which HBM sits idle. Launched with ``launch_pdl``, a kernel may be scheduled
while the one before it is still running: ``begin`` at the top of each of our kernels first
signals that the next kernel may launch (it then starts once every program of this one has
signalled), then waits (``griddepcontrol.wait``) until the kernel before has completed and its
writes are visible. Nothing but weights is read, and nothing is written, before that wait, so
every kernel still sees a finished predecessor; what overlaps is the launch, the scheduling and,
in the GEMV, the loads of the first weight tile. A kernel launched without
the attribute (torch's own, or any kernel when PDL is off) passes the wait at once.

PDL is for the decode step and its verify blocks: launches over more than ``MAX_TOKENS`` tokens
(prefill) go without it, since a long kernel has no launch latency worth hiding.
``LUCE_TUNE_PDL=0`` (or ``ENABLED = False``) launches as before; the default uses PDL on CUDA
devices of compute capability 9.0 and above, never under the Triton interpreter.
``LUCE_TUNE_PDL_SKIP`` names kernel families (``FAMILIES``, comma-separated) launched without it,
for measuring one family's share.

Prefetching (``PREFETCH``, ``LUCE_TUNE_PDL_PREFETCH=0`` to turn it off): a few more kernels load before
their wait what no kernel since the last non-PDL launch writes, so those loads overlap the kernel
before. The router its weights; the delta rule its layer's recurrent state (only that layer's own
delta rule writes it, one step earlier, and a step's graph, or torch's launches between eager steps,
lie between); the experts' down launch its expert ids and weights, because its gate/up launch then
waits before it lets the down launch start (``gate_up_waits_first``), so the router that wrote the ids
has completed by then. Under the interpreter the wait does nothing and the prefetching code is run as
any other, so the CPU tests check its sums.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV = "LUCE_TUNE_PDL"
SKIP_ENV = "LUCE_TUNE_PDL_SKIP"
ENABLED: bool | None = None  # None: where the device supports it, unless LUCE_TUNE_PDL=0
PREFETCH_ENV = "LUCE_TUNE_PDL_PREFETCH"
PREFETCH: bool | None = None  # None: unless LUCE_TUNE_PDL_PREFETCH=0
MAX_TOKENS = 16  # the decode step's launches (verify blocks included); prefill goes without
FAMILIES = ("gemv", "experts", "router", "norm", "gdn", "attention")
_capable: dict[torch.device, bool] = {}


def enabled(device: torch.device, tokens: int = 1, family: str = "") -> bool:
    """Whether a launch over ``tokens`` tokens of the kernel ``family`` on ``device`` uses programmatic
    dependent launch."""
    if family and family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r} (one of {FAMILIES})")
    if tokens > MAX_TOKENS or device.type != "cuda":
        return False
    if family and family in os.environ.get(SKIP_ENV, "").split(","):
        return False
    if ENABLED is not None:
        return ENABLED
    if os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if device not in _capable:
        _capable[device] = torch.cuda.get_device_capability(device) >= (9, 0)
    return _capable[device]


def launch(device: torch.device, tokens: int = 1, family: str = "") -> dict[str, bool]:
    """Keyword arguments for a launch of a kernel that calls ``begin(PDL)``: the kernel's ``PDL``
    flag and Triton's ``launch_pdl`` option, always set together (a kernel launched with the
    attribute must wait before touching its inputs)."""
    on = enabled(device, tokens, family)
    return {"PDL": on, "launch_pdl": on}


def prefetch() -> bool:
    """Whether the kernels that can load inputs before their wait do so (module docstring)."""
    if PREFETCH is not None:
        return PREFETCH
    return os.environ.get(PREFETCH_ENV, "1") != "0"


@triton.jit
def begin(PDL: tl.constexpr):
    """The first statement of a kernel launched with ``launch``'s arguments."""
    launch_next(PDL)
    wait_previous(PDL)


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has got here."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Wait for the kernel before to complete, its writes visible. Before it, a kernel may only read
    what no kernel of the step writes (its weights): a kernel two back may still be running."""
    if PDL:
        gdc_wait()
