"""The CPU share of the cold experts (``engine.kernels.host_experts``): the native threads' SwiGLU sums
against a float64 reference over dequantized blocks, at odd sizes, Q4_0 and Q8_0, ggml's block order and
the split layout, 1 and 3 threads, successive jobs on several layers; a job the threads cannot run
reported as an error; bad matrices refused before any thread sees them. The device's publish and
collect launches are checked on CUDA (the hybrid executor's tests)."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine.errors import ConfigError
from engine.gguf import quants
from engine.kernels.host_experts import WARM_CHUNK, HostShare, HostShareError, describe_threads, stall_report
from engine.kernels.quant.reference import split_rows

SIZES = {Q.Q4_0: 18, Q.Q8_0: 34}


def blocks(qtype, experts, rows, cols, seed):
    """Random valid blocks uint8 [experts, rows, row_bytes] in ggml's order (fp16 scale, then codes)."""
    rng = np.random.default_rng(seed)
    nb, size = cols // 32, SIZES[qtype]
    raw = rng.integers(0, 256, (experts, rows, nb, size), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.03, (experts, rows, nb)).astype(np.float16) * rng.choice([-1, 1], (experts, rows, nb))
    raw[..., :2] = scales.astype(np.float16).view(np.uint8).reshape(experts, rows, nb, 2)
    return torch.from_numpy(raw.reshape(experts, rows, nb * size).copy())


def dense(b, qtype, rows, cols):
    return quants.dequantize(b.reshape(-1, b.shape[-1]), qtype, (b.shape[0], rows, cols)).double()


def reference(x, ids, w, mine, gate, up, down):
    """float64 [T, H]: each token's pairs with ``mine`` set, weighted."""
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e < 0 or not mine[e]:
                continue
            h = F.silu(gate[e] @ x[t].double()) * (up[e] @ x[t].double())
            out[t] += float(w[t, j]) * (down[e] @ h)
    return out


def layer(qtype, layout, experts, hidden, ffn, seed):
    mats, ref = [], []
    for which, (rows, cols) in enumerate([(ffn, hidden), (ffn, hidden), (hidden, ffn)]):
        b = blocks(qtype, experts, rows, cols, seed + which)
        ref.append(dense(b, qtype, rows, cols))
        if layout == "split":
            b = split_rows(b.reshape(experts * rows, -1), qtype).reshape(experts, rows, -1).contiguous()
        mats.append((b, qtype, rows, cols, layout))
    return mats, ref


# the builds: the machine's widest vectors, and the narrower paths forced off (skipped where the first
# already is one of them); the prefetch off too; chunks taken by any thread (the default build keeps each thread's own)
BUILDS = {"native": None, "avx2": ["-mno-avx512f"], "portable": ["-mno-avx2", "-mno-avx512f"], "no-prefetch": ["-DLT_PF=0"],
          "any-thread": ["-DLT_AFFINITY=0"]}


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
@pytest.mark.parametrize("layout", ["ggml", "split"])
@pytest.mark.parametrize("threads,build", [(1, "native"), (3, "native"), (2, "avx2"), (2, "portable"),
                                           (1, "no-prefetch"), (3, "any-thread"), (1, "any-thread")])
def test_threads_sum_their_pairs_as_the_reference(qtype, layout, threads, build):
    hidden, ffn, experts, k = 96, 64, 7, 3
    layers = [layer(qtype, layout, experts, hidden, ffn, seed=10 * i) for i in range(2)]
    share = HostShare([m for m, _ in layers] + [None], hidden=hidden, ffn=ffn, threads=threads, device="cpu",
                      max_tokens=5, max_pairs=16, cflags=BUILDS[build])
    if build == "avx2" and share.simd != 256 or build == "portable" and share.simd != 0:
        share.close()
        pytest.skip(f"this compiler or machine does not build the {build} path (vector bits {share.simd})")
    try:
        g = torch.Generator().manual_seed(threads)
        for job, (li, T) in enumerate([(0, 1), (1, 3), (0, 5), (1, 2), (1, 1)]):
            x = torch.randn(T, hidden, generator=g).to(torch.bfloat16)
            ids = torch.randint(0, experts, (T, k), generator=g)
            ids[0, 1] = -1  # a hot pair: -1 in the cold tier's ids
            w = torch.rand(T, k, generator=g)
            mine = (torch.rand(experts, generator=g) < 0.6).to(torch.int8)
            out = torch.full((T, hidden), 0.25)
            share.publish(li, x, ids, w, mine)
            share.collect(out)
            want = reference(x.float(), ids, w, mine, *layers[li][1]) + 0.25
            scale = want.abs().max().item() + 1e-6
            assert (out.double() - want).abs().max().item() <= 2e-5 * scale, (job, li, T)
        assert share.jobs == 5
    finally:
        share.close()


def test_a_layer_with_no_matrices_is_reported():
    hidden, ffn = 64, 32
    mats, _ = layer(Q.Q4_0, "ggml", 4, hidden, ffn, seed=1)
    share = HostShare([mats, None], hidden=hidden, ffn=ffn, threads=2, device="cpu", max_tokens=2, max_pairs=8)
    try:
        x, ids, w = torch.randn(1, hidden), torch.tensor([[0, 1]]), torch.ones(1, 2)
        share.publish(1, x, ids, w, torch.ones(4, dtype=torch.int8))
        with pytest.raises(HostShareError, match="no matrices registered"):
            share.collect(torch.zeros(1, hidden))
    finally:
        share.close()


def test_thread_states_say_where_each_thread_stands():
    """After jobs and a warm-up every thread is back to idle at the last job's number, with the longest stretch it
    spent in a job's state kept; a failed job's error says where the threads stood."""
    hidden, ffn, experts = 64, 32, 4
    mats, _ = layer(Q.Q4_0, "ggml", experts, hidden, ffn, seed=4)
    share = HostShare([mats, None], hidden=hidden, ffn=ffn, threads=3, device="cpu", max_tokens=2, max_pairs=8)
    try:
        fresh = share.thread_states()
        assert [st["state"] for st in fresh] == ["idle"] * 3 and all(st["seq"] == 0 for st in fresh)
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            share.publish(0, torch.randn(2, hidden, generator=g), torch.randint(0, experts, (2, 2), generator=g),
                          torch.rand(2, 2, generator=g), torch.ones(experts, dtype=torch.int8))
            share.collect(torch.zeros(2, hidden))
        share.warm(0, [1, 2])
        deadline = time.monotonic() + 10
        states = share.thread_states()
        while any(st["state"] != "idle" or st["seq"] != 3 for st in states):
            assert time.monotonic() < deadline, states
            time.sleep(0.001)
            states = share.thread_states()
        assert all(st["longest_ms"] > 0 for st in states)  # each thread at least looked at each job
        assert {st["longest_state"] for st in states} <= {"warm-up", "gate/up", "waiting for gate/up", "down"}
        assert stall_report(share, [], 0.0) is None  # idle threads do not stand still
        text = describe_threads(states)
        assert text.startswith("threads: 3 idle at number 3 (up to ") and "longest stretch: thread " in text
        share.publish(1, torch.randn(1, hidden), torch.tensor([[0, 1]]), torch.ones(1, 2),
                      torch.ones(experts, dtype=torch.int8))
        with pytest.raises(HostShareError, match=r"no matrices registered \(the threads answered 4 jobs; the "
                                                 r"mailbox names number 4, the last reply 4; threads: "):
            share.collect(torch.zeros(1, hidden))
    finally:
        share.close()


def test_describe_threads_groups_them_by_state_and_number():
    states = [{"state": "idle", "seq": 7, "ms": 0.5, "longest_ms": 0.2, "longest_state": "down"},
              {"state": "gate/up", "seq": 8, "ms": 16200.0, "longest_ms": 16200.0, "longest_state": "gate/up"},
              {"state": "idle", "seq": 7, "ms": 1.5, "longest_ms": 0.3, "longest_state": "waiting for gate/up"}]
    assert describe_threads(states) == ("threads: 2 idle at number 7 (up to 1.5 ms), 1 gate/up at number 8 (up to "
                                        "16,200.0 ms); longest stretch: thread 1 in gate/up for 16,200.0 ms")
    assert describe_threads([]) == "no thread state"
    share = SimpleNamespace(thread_states=lambda: states)  # HostShare.thread_states as they were
    assert stall_report(share, [], 10.0) == describe_threads(states)  # thread 1 in gate/up for 16.2 s
    assert stall_report(share, [], 20.0) is None


def test_bad_matrices_are_refused_up_front():
    hidden, ffn = 64, 32
    mats, _ = layer(Q.Q4_0, "ggml", 4, hidden, ffn, seed=2)
    with pytest.raises(ConfigError, match="Q4_0 and Q8_0"):
        HostShare([[(mats[0][0], Q.Q4_K, ffn, hidden, "ggml")] + mats[1:]], hidden=hidden, ffn=ffn, threads=1,
                  device="cpu")
    with pytest.raises(ConfigError, match="does not fit"):  # the gate's rows wider than the pool's ffn
        HostShare([mats], hidden=hidden, ffn=ffn // 2, threads=1, device="cpu")
    with pytest.raises(ConfigError, match="at least one thread"):
        HostShare([mats], hidden=hidden, ffn=ffn, threads=0, device="cpu")


def test_more_tokens_than_the_mailbox_holds_are_refused():
    hidden, ffn = 64, 32
    mats, _ = layer(Q.Q8_0, "ggml", 4, hidden, ffn, seed=3)
    share = HostShare([mats], hidden=hidden, ffn=ffn, threads=1, device="cpu", max_tokens=2, max_pairs=4)
    try:
        with pytest.raises(ValueError, match="do not fit"):
            share.publish(0, torch.randn(3, hidden), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1),
                          torch.ones(4, dtype=torch.int8))
    finally:
        share.close()


# chunks of gate/up rows that are not whole 32-blocks of h, and short chunks of output rows, prefetching in the
# 8-bit loop: the small jobs' settings that the benchmarks try (bench/host_share_pool.py --cflags)
FINE = ["-DLT_CHUNK1=8", "-DLT_CHUNK2=16", "-DLT_PF8=1024"]
ANY_THREAD = ["-DLT_AFFINITY=0"]


@pytest.mark.parametrize("int8,cflags", [(False, None), (True, None), (True, FINE), (False, ANY_THREAD),
                                         (True, ANY_THREAD + FINE)])
def test_any_thread_count_gives_the_same_bits_over_many_jobs(int8, cflags):
    """Each thread takes its own chunks first, then any left (with ``LT_AFFINITY=0``, whichever chunk comes), and each
    output row is still summed in pair order: 1 and 6 threads (more threads than some jobs have chunks) give
    identical sums over 60 back-to-back jobs, and so does the default build on 2 (chunks of other sizes change no
    sum). In 8-bit mode each thread rounds h itself for the
    pairs its output rows need: the same codes whoever makes them."""
    hidden, ffn, experts, k = 64, 96, 5, 4
    layers = [layer(Q.Q4_0, "split", experts, hidden, ffn, seed=40 + i)[0] for i in range(3)]
    shares = [HostShare(layers, hidden=hidden, ffn=ffn, threads=t, device="cpu", max_tokens=4, max_pairs=16,
                        int8=int8, cflags=c) for t, c in ((1, cflags), (6, cflags), (2, None))]
    try:
        g = torch.Generator().manual_seed(7)
        for job in range(60):
            T = int(torch.randint(1, 5, (1,), generator=g))
            x, w = torch.randn(T, hidden, generator=g), torch.rand(T, k, generator=g)
            ids = torch.randint(-1, experts, (T, k), generator=g)
            mine = (torch.rand(experts, generator=g) < 0.7).to(torch.int8)
            outs = []
            for share in shares:
                out = torch.zeros(T, hidden)
                share.publish(job % 3, x, ids, w, mine)
                share.collect(out)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), job
        assert [s.jobs for s in shares] == [60, 60, 60]
    finally:
        for share in shares:
            share.close()


def quantize8(x):
    """8-bit activations as the threads make them: per 32-block, float32 ops, ties to even; x ~ q * d."""
    xb = x.float().reshape(-1, 32)
    amax = xb.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-127, 127)
    return (q * (amax / torch.tensor(127.0))).double().reshape(x.shape)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
@pytest.mark.parametrize("layout", ["ggml", "split"])
@pytest.mark.parametrize("cols", [96, 512, 1536])
def test_dot8_is_the_quantized_rows_dot_product(qtype, layout, cols):
    """The 8-bit mode's dot product, by the plain loop and by VNNI where built (rows of 512k columns): the
    float64 dot product of the dequantized row with x rounded to 8 bits, to float32 rounding."""
    mats, ref = layer(qtype, layout, 1, cols, 32, seed=cols)
    share = HostShare([mats], hidden=cols, ffn=32, threads=1, device="cpu", int8=True)
    try:
        g = torch.Generator().manual_seed(cols)
        for trial in range(4):
            x = torch.randn(cols, generator=g) * (10.0 ** trial)
            x[:32] = 0.0  # a block of zeros: scale 0
            x[40] = 7.5 * x.abs().max()  # a block with one large value
            for r in (0, 17):
                want = (ref[0][0, r] * quantize8(x)).sum().item()
                bound = 1e-5 * (ref[0][0, r].abs() * quantize8(x).abs()).sum().item()
                plain, vnni = share.dot8(mats[0][0][0, r], qtype, layout, x)
                assert abs(plain - want) <= bound, (trial, r)
                if share.vnni and cols % 512 == 0:
                    assert abs(vnni - want) <= bound, (trial, r)
                else:
                    assert vnni != vnni  # NaN: not computed
    finally:
        share.close()


def reference8(x, ids, w, mine, gate, up, down):
    """``reference`` with the token rows and each expert's inner activations rounded to 8 bits first."""
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        xq = quantize8(x[t])
        for j in range(k):
            e = int(ids[t, j])
            if e < 0 or not mine[e]:
                continue
            h = (F.silu(gate[e] @ xq) * (up[e] @ xq)).float()
            out[t] += float(w[t, j]) * (down[e] @ quantize8(h))
    return out


def code_step_of_h(x, e, gate, up, down):
    """The most one 8-bit code of expert ``e``'s h (for token row ``x``) moves any output: the largest code step
    of its 32-blocks times the largest down weight."""
    xq = quantize8(x)
    h = (F.silu(gate[e] @ xq) * (up[e] @ xq)).float()
    return (h.reshape(-1, 32).abs().amax(dim=1) / 127).max().item() * down[e].abs().max().item()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
@pytest.mark.parametrize("layout", ["ggml", "split"])
@pytest.mark.parametrize("hidden,ffn", [(96, 64), (512, 512)])
@pytest.mark.parametrize("cflags", [None, FINE], ids=["default", "fine"])
def test_int8_threads_sum_as_the_quantized_reference(qtype, layout, hidden, ffn, cflags):
    """Whole jobs in 8-bit mode (3 threads; 512 x 512 takes the VNNI loop where built): within float32 rounding of
    the reference that rounds x and h to 8 bits, and several times closer to it than to the float32 reference
    (the rounding to 8 bits is there, and is all that differs).

    The threads compute h in float32 and the reference in float64, so an h value within float32 rounding of a
    rounding boundary takes the neighbouring 8-bit code on one side: about one value in a thousand, seen on
    AVX2-only hosts in the plain loop's sums. Each such value moves an output by at most one code step of its
    h block times its down weight and routing weight (``flip``); up to two of them are allowed."""
    experts, k = 5, 3
    layers = [layer(qtype, layout, experts, hidden, ffn, seed=20 + 10 * i) for i in range(2)]
    share = HostShare([m for m, _ in layers], hidden=hidden, ffn=ffn, threads=3, device="cpu", max_tokens=3,
                      max_pairs=9, int8=True, cflags=cflags)
    try:
        g = torch.Generator().manual_seed(hidden)
        for job, (li, T) in enumerate([(0, 1), (1, 3), (0, 2)]):
            x, w = torch.randn(T, hidden, generator=g), torch.rand(T, k, generator=g)
            ids = torch.randint(0, experts, (T, k), generator=g)
            mine = torch.ones(experts, dtype=torch.int8)
            out = torch.zeros(T, hidden)
            share.publish(li, x, ids, w, mine)
            share.collect(out)
            want8 = reference8(x, ids, w, mine, *layers[li][1])
            want = reference(x, ids, w, mine, *layers[li][1])
            scale = want.abs().max().item()
            err8, err = (out.double() - want8).abs().max().item(), (out.double() - want).abs().max().item()
            flip = max(float(w[t, j]) * code_step_of_h(x[t], int(ids[t, j]), *layers[li][1])
                       for t in range(T) for j in range(k))
            assert err8 <= 2e-4 * scale + 2 * flip and err8 * 4 < err, (job, err8, err, scale, flip)
    finally:
        share.close()


PREFETCHES = ["-DLT_WARM_LOAD=0"]  # the warm-up by prefetches (by loads is the default)


def count_reaches(count, n, settle=0.0):
    """``count()`` once it reaches ``n`` or 10 s have passed, read again after ``settle`` seconds."""
    import time

    deadline = time.perf_counter() + 10
    while count() < n and time.perf_counter() < deadline:
        time.sleep(0.001)
    time.sleep(settle)
    return count()


def same_sums(shares, layer_index, g, hidden, experts, k, warm=0):
    """One random job of two tokens on ``layer_index`` published to each pool in turn (the last one first named the
    job's first ``warm`` experts as a warm-up): every pool sums the same bits."""
    x, w = torch.randn(2, hidden, generator=g), torch.rand(2, k, generator=g)
    ids = torch.randint(0, experts, (2, k), generator=g)
    mine = torch.ones(experts, dtype=torch.int8)
    if warm:
        shares[-1].warm(layer_index, ids.reshape(-1)[:warm].tolist())
    outs = []
    for share in shares:
        out = torch.zeros(2, hidden)
        share.publish(layer_index, x, ids, w, mine)
        share.collect(out)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:]), layer_index


@pytest.mark.parametrize("int8,cflags", [(False, ANY_THREAD), (True, ANY_THREAD), (False, None), (True, None),
                                         (True, PREFETCHES), (False, PREFETCHES + ANY_THREAD)])
def test_warm_ups_are_fetched_and_change_no_sum(int8, cflags):
    """A warm-up names experts of a layer: idle threads fetch every chunk of their three matrices (16 KiB
    chunks: ceil(bytes / 16384) each with ``LT_AFFINITY=0``; by default the job's chunks, 32 gate/up rows and 64
    output rows, each by its owner; ``warm_per_expert`` says which), by loads or, with ``LT_WARM_LOAD=0``, by
    prefetches; bad names are ignored, and jobs published between warm-ups of the experts they use, before or after
    them, sum the same bits as with no warm-up at all."""
    hidden, ffn, experts, k = 96, 96, 6, 3
    layers = [layer(Q.Q4_0, "ggml", experts, hidden, ffn, seed=70 + i)[0] for i in range(2)]
    plain = HostShare(layers, hidden=hidden, ffn=ffn, threads=2, device="cpu", max_tokens=2, max_pairs=8, int8=int8)
    warmed = HostShare(layers, hidden=hidden, ffn=ffn, threads=3, device="cpu", max_tokens=2, max_pairs=8, int8=int8,
                       cflags=cflags)
    try:
        per_expert = (sum(-(-b.shape[1] * b.shape[2] // WARM_CHUNK) for b, *_ in layers[0])
                      if cflags and ANY_THREAD[0] in cflags
                      else -(-ffn // 32) + -(-hidden // 64))  # 3 gate/up chunks and 2 of output rows
        assert warmed.warm_per_expert(0) == per_expert and warmed.warm_per_expert(7) == -1
        warmed.warm(0, [1, 4])
        assert count_reaches(lambda: warmed.warm_chunks, 2 * per_expert) == 2 * per_expert
        warmed.warm(1, [experts, -1])  # out of range and none: nothing fetched, nothing breaks
        warmed.warm(7, [0])  # no such layer
        assert count_reaches(lambda: warmed.warm_chunks, 2 * per_expert, settle=0.05) == 2 * per_expert
        g = torch.Generator().manual_seed(3)
        for job in range(12):
            same_sums((plain, warmed), job % 2, g, hidden, experts, k, warm=4)
        assert warmed.jobs == 12
        assert count_reaches(lambda: warmed.warm_chunks, 2 * per_expert + 1) > 2 * per_expert  # the last, at least
        with pytest.raises(ValueError, match="1 to 8 experts"):
            warmed.warm(0, [])
    finally:
        plain.close()
        warmed.close()


@pytest.mark.parametrize("int8", [False, True])
def test_warm_ups_ahead_follow_the_last_warm_up_and_change_no_sum(int8):
    """With ``-DLT_SPEC=1``, once a job is answered the threads fetch the experts the last warm-up named for the layer
    whose warm-up followed that job's layer last time: nothing before the pool has seen such an order, every chunk of
    those experts once it has, and a warm-up that then names them fetches none again. Jobs sum the same bits as the
    default pool's; the default pool reports no count."""
    hidden, ffn, experts, k = 96, 96, 6, 3
    layers = [layer(Q.Q4_0, "ggml", experts, hidden, ffn, seed=90 + i)[0] for i in range(3)]
    plain = HostShare(layers, hidden=hidden, ffn=ffn, threads=2, device="cpu", max_tokens=2, max_pairs=8, int8=int8)
    spec = HostShare(layers, hidden=hidden, ffn=ffn, threads=3, device="cpu", max_tokens=2, max_pairs=8, int8=int8,
                     cflags=["-DLT_SPEC=1"])
    try:
        assert plain.spec_chunks is None and spec.spec_chunks == 0
        per_expert = -(-ffn // 32) + -(-hidden // 64)  # 3 gate/up chunks and 2 of output rows
        g = torch.Generator().manual_seed(5)

        def job(layer_index):
            same_sums((plain, spec), layer_index, g, hidden, experts, k)

        def settle(count, n):
            return count_reaches(count, n, settle=0.05)

        job(0)  # no warm-up has followed a job of layer 0 yet: nothing to fetch ahead
        assert settle(lambda: spec.spec_chunks, 1) == 0
        spec.warm(2, [1, 4])  # after a job of layer 0 comes layer 2's warm-up, naming 1 and 4
        warmed = settle(lambda: spec.warm_chunks, 2 * per_expert)
        assert warmed == 2 * per_expert
        job(2)
        job(0)  # answered: layer 2's experts 1 and 4 fetched ahead
        assert settle(lambda: spec.spec_chunks, 2 * per_expert) == 2 * per_expert
        spec.warm(2, [1, 4])  # the same names: nothing left to fetch
        assert settle(lambda: spec.warm_chunks, warmed + 1) == warmed
        job(2)
        spec.warm(1, [0, 5])  # no job since: layer 1 is not noted as following layer 2
        assert settle(lambda: spec.warm_chunks, warmed + 2 * per_expert) == warmed + 2 * per_expert
        for i in range(6):
            job(i % 3)
        assert spec.spec_chunks >= 2 * per_expert and spec.jobs == plain.jobs == 10
    finally:
        plain.close()
        spec.close()
