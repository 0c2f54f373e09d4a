"""Warps per program of the decode step's small Triton launches, by kernel.

These launches are latency-bound at one token: a few programs, each reading one row or one head
and reducing over it. More warps spread a program's loads over more lanes, but reductions across
warps go through shared memory and barriers, within one warp by shuffles. The fastest count is
measured per kernel on a GPU by ``bench/small_kernels.py`` (each kernel alone, timed in a CUDA
graph) and ``bench/profile_decode.py --kernel-variants NAME-warps=N`` (the captured step). The
wrappers read ``WARPS`` at each call, so a benchmark can set an entry before it captures a step.
"""

from __future__ import annotations

WARPS = {
    "router": 1,  # ``moe_gate.route_triton``: 4.42 us against 5.28 at 4 warps on the H200
    "norm": 4,  # ``rms_norm``: RMSNorm, the residual add + RMSNorm, Gated DeltaNet's gated norm (rows up to 4096)
    "rope": 4,  # ``rope_norm``: the query heads' norm + RoPE, the keys' norm + RoPE into the cache
    "gdn_prologue": 4,  # ``gdn_prologue``: conv, SiLU, q/k norms, gates
    "delta_rule": 4,  # ``gdn_decode``: the delta rule's decode step
    "attention_chunk": 4,  # ``decode_attention``: a chunk of keys per program
    "attention_combine": 4,  # ``decode_attention``: the chunks' partial results combined (and gated)
}
CHOICES = (1, 2, 4, 8)


def warps(name: str) -> int:
    """The warps per program of the kernel ``name`` (a key of ``WARPS``)."""
    return WARPS[name]


def set_warps(name: str, n: int) -> None:
    """Sets one kernel's warps (for benchmarks); a name or count outside the table is refused."""
    if name not in WARPS or n not in CHOICES:
        raise ValueError(f"warps: {name!r}={n} is not one of {', '.join(WARPS)} with {CHOICES}")
    WARPS[name] = n
