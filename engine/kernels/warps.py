"""Warps per program of the decode step's small Triton launches, by kernel.

These launches are latency-bound at one token: a few programs, each reading one row or one head
and reducing over it. More warps spread a program's loads over more lanes, but reductions across
warps go through shared memory and barriers, within one warp by shuffles. The fastest count is
measured per kernel on a GPU by ``bench/small_kernels.py`` (each kernel alone, timed in a CUDA
graph) and ``bench/profile_decode.py --kernel-variants NAME-warps=N`` (the captured step); the
figures below are the H200's at the 35B shapes, each launch alone. The wrappers read ``WARPS`` at
each call, so a benchmark can set an entry before it captures a step.
"""

from __future__ import annotations

WARPS = {
    "router": 1,  # ``moe_gate.route_triton``: 4.42 us against 5.28 at 4 warps on the H200
    "norm": 8,  # ``rms_norm``: RMSNorm and the residual add + RMSNorm (rows up to 4096): 1.26 us against 1.39 at 4
    "gated_norm": 1,  # ``rms_norm``: Gated DeltaNet's gated norm, a row per head: 1.06 us against 1.22 at 4
    # ``rope_norm``: the query heads' norm + RoPE (1.12 us against 1.29 at 4), the keys' into the cache (1.19, 1.32)
    "rope": 1,
    "gdn_prologue": 4,  # ``gdn_prologue``: conv, SiLU, q/k norms, gates (2.57 us; 2.72 at 2 warps)
    "delta_rule": 2,  # ``gdn_decode``: the delta rule's decode step (with the gated norm inside: 4.28 us against 4.46)
    "attention_chunk": 4,  # ``decode_attention``: a chunk of keys per program (10.85 us at 4,096 keys)
    "attention_combine": 4,  # ``decode_attention``: the chunks' partial results combined (and gated) (10.97 us)
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
