"""How fast the GPU reads experts kept in pinned host memory (``cold_device="gpu"``).

    python bench/host_reads.py [--gib 2] [--repeats 20] [--json out.json]

Three ways for the device to use bytes that live in host memory, each timed with CUDA events
(median of ``--repeats`` after warm-up), as GB/s of the bytes involved:
- ``copy``: a DMA copy host -> device of the whole buffer (what copied runs do);
- ``mapped sum``: a torch reduction over the buffer read in place through the mapped view;
- ``experts``: the routed-expert launches of one decode token (8 pairs, Q4_0 at the 35B expert
  shapes, split layout) over 256 experts held in host memory read in place, the same after the
  routed experts are gathered into a device buffer (``engine.kernels.gather``, the cold tier's
  decode path), and the same experts on the device. The cold tier's cost per token is about
  (cold pairs per token) x (bytes per expert) / that rate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from common import commit, machine, time_ms
from gguf import GGMLQuantizationType as Q

from engine.gguf.quants import random_quantized
from engine.hybrid import mapped_view, quantized_moe
from engine.kernels.gather import gather_experts
from engine.kernels.quant import QuantExperts

EXPERTS, PAIRS, HIDDEN, FFN = 256, 8, 2048, 512


def buffer_rates(n: int, dev: torch.device, repeats: int) -> dict[str, float]:
    """GB/s of a DMA copy of ``n`` pinned bytes to the device, and of a reduction reading them in place."""
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    mapped = mapped_view(host, dev).view(torch.int32)
    return {"copy": n / (time_ms(lambda: dst.copy_(host, non_blocking=True), 3, repeats)["ms"] * 1e-3) / 1e9,
            "mapped sum": n / (time_ms(lambda: mapped.sum(), 3, repeats)["ms"] * 1e-3) / 1e9}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="size of the buffer for copy and sum")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/host_reads.py needs a CUDA device")
    dev = torch.device("cuda")
    rows = buffer_rates(int(args.gib * 2**30) // 4 * 4, dev, args.repeats)

    rng = np.random.default_rng(0)
    stacks = []
    for rows_, cols in ((FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)):
        raw = random_quantized((EXPERTS, rows_, cols), Q.Q4_0, rng, 0.02)
        qe = QuantExperts.from_gguf_bytes(raw, Q.Q4_0, EXPERTS, rows_, cols).with_layout("split")
        pinned = qe.raw.pin_memory()
        stacks.append((QuantExperts(mapped_view(pinned, dev), Q.Q4_0, EXPERTS, rows_, cols, "split"), pinned,
                       qe.to(dev)))
    on_host = [s[0] for s in stacks]
    on_device = [s[2] for s in stacks]
    x = torch.randn(1, HIDDEN, device=dev).bfloat16()
    w = torch.softmax(torch.randn(1, PAIRS, device=dev), -1)
    draws = [torch.randperm(EXPERTS, device=dev)[:PAIRS].reshape(1, PAIRS) for _ in range(64)]
    ref = quantized_moe(x, on_device, draws[0], w)
    got = quantized_moe(x, on_host, draws[0], w)
    if not torch.allclose(got.float(), ref.float(), rtol=0, atol=0):
        raise SystemExit("the experts read from host memory differ from the same experts on the device")
    token_bytes = PAIRS * sum(e.nbytes for e in on_device) // EXPERTS
    step = {"i": 0}

    def one(experts):
        step["i"] = (step["i"] + 1) % len(draws)
        return quantized_moe(x, experts, draws[step["i"]], w)

    # the cold tier's decode path: the routed experts gathered into a device buffer in one launch per
    # matrix (engine.kernels.gather), then the expert launches over the buffer
    buffers = [torch.empty((PAIRS, *e.raw.shape[1:]), dtype=torch.uint8, device=dev) for e in on_device]
    staged_ids = torch.arange(PAIRS, device=dev).reshape(1, PAIRS)
    staged = [QuantExperts(b, Q.Q4_0, PAIRS, e.n, e.k, "split") for b, e in zip(buffers, on_device)]

    def gathered(ids):
        for e, b in zip(on_host, buffers):
            gather_experts(e.raw, b, ids.reshape(-1))
        return quantized_moe(x, staged, staged_ids, w)

    if not torch.equal(gathered(draws[0]), ref):
        raise SystemExit("the experts gathered from host memory differ from the same experts on the device")

    def one_gathered():
        step["i"] = (step["i"] + 1) % len(draws)
        return gathered(draws[step["i"]])

    ms_host = time_ms(lambda: one(on_host), 3, args.repeats)["ms"]
    ms_gather = time_ms(one_gathered, 3, args.repeats)["ms"]
    ms_dev = time_ms(lambda: one(on_device), 3, args.repeats)["ms"]
    rows["experts (host)"] = token_bytes / (ms_host * 1e-3) / 1e9
    rows["experts (gathered)"] = token_bytes / (ms_gather * 1e-3) / 1e9
    rows["experts (device)"] = token_bytes / (ms_dev * 1e-3) / 1e9
    print(f"{machine()}: GB/s of the bytes read (buffer {args.gib:g} GiB; one token's 8 Q4_0 experts "
          f"{token_bytes / 1e6:.1f} MB: {ms_host * 1e3:.0f} us read in place from host memory, {ms_gather * 1e3:.0f} "
          f"us gathered to the device first, {ms_dev * 1e3:.0f} us on the device)")
    for name, gbs in rows.items():
        print(f"  {name:>17}: {gbs:8.1f} GB/s")
    if args.json:
        experts_us = {"host": ms_host * 1e3, "gathered": ms_gather * 1e3, "device": ms_dev * 1e3}
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "gib": args.gib, "gb_s": rows,
                                         "experts_us": experts_us, "token_bytes": token_bytes}, indent=1))


if __name__ == "__main__":
    main()
