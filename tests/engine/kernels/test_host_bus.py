"""The bus's copier (``engine.kernels.host_experts.HostBus``, ``host_experts.c``'s copier thread): named experts'
slabs land in the stage's rows in the order named, nothing else is written, the job's number lands after its
copies, a bad job is reported without a hang, and bad stages or blocks are refused when it starts. On the CPU the
thread copies with ``memcpy`` into host tensors standing in for device memory; on CUDA with the copy engine
(``cuMemcpyHtoDAsync_v2``), from pinned blocks into device rows."""

import ctypes
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from engine.errors import ConfigError
from engine.kernels.host_experts import (BUS_IDS, BUS_LAYER, BUS_N, BUS_RING, BUS_SEQ, BUS_SLOTS, HostBus,
                                         HostShareError, copier_state, describe_copier, library,
                                         stall_report)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = ((5, 18), (5, 18), (3, 34))  # gate, up, down: rows x row bytes, odd sizes


def blocks(experts, seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    pin = DEVICE == "cuda"
    return tuple(torch.randint(0, 256, (experts, *s), generator=g, dtype=torch.uint8).pin_memory() if pin
                 else torch.randint(0, 256, (experts, *s), generator=g, dtype=torch.uint8) for s in shapes)


def stage(rows=4, shapes=SHAPES):
    return tuple(torch.full((rows, *s), 7, dtype=torch.uint8, device=DEVICE) for s in shapes)


@pytest.fixture
def bus():
    layers = [blocks(11, 1), None, blocks(13, 3)]  # the middle layer is never fetched
    rows = stage()
    b = HostBus(layers, rows, device=DEVICE)
    yield b, layers, rows
    b.close()


def test_named_experts_land_in_their_rows(bus):
    b, layers, rows = bus
    assert b.rows == 4
    for n, (layer, named) in enumerate(((0, [3, 10]), (2, [12, -1, 0, 5]), (0, [-1]), (2, [4, 4, 1]))):
        before = [r.clone() for r in rows]
        b.fetch(layer, named)
        b.wait()
        assert b.jobs == n + 1 and int(b.flag) == n + 1
        for which in range(3):
            for j in range(4):
                e = named[j] if j < len(named) else -1
                want = layers[layer][which][e].to(DEVICE) if e >= 0 else before[which][j]
                assert torch.equal(rows[which][j], want), (layer, named, which, j)
    b.check()


def test_many_jobs_back_to_back_each_land_before_their_number(bus):
    """Each job's rows are complete when its number is seen, over jobs that overwrite the same rows."""
    b, layers, rows = bus
    g = torch.Generator().manual_seed(5)
    for _ in range(40):
        layer = (0, 2)[int(torch.randint(0, 2, (1,), generator=g))]
        experts = layers[layer][0].shape[0]
        named = torch.randint(0, experts, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        b.fetch(layer, named)
        b.wait()
        for which in range(3):
            for j, e in enumerate(named):
                assert torch.equal(rows[which][j], layers[layer][which][e].to(DEVICE))
    assert b.jobs == 40


@pytest.mark.parametrize("layer,named,text", [(1, [0], "not registered"), (0, [11], "out of range"),
                                              (5, [0], "not registered")])
def test_a_bad_job_is_reported_and_its_number_still_lands(bus, layer, named, text):
    b, layers, rows = bus
    before = [r.clone() for r in rows]
    b.fetch(layer, named)
    with pytest.raises(HostShareError, match=rf"{text}.*ran 1 jobs; the mailbox names number 1, layer {layer}, "
                                             r"1 experts; the copier last took number 1, is .*; its longest copy "
                                             r"call took [0-9.,]+ ms; the last number landed 1\)"):
        b.wait()  # where the copier stood is in the message
    assert int(b.flag) == 1  # the device's wait ends: the number is written whatever the job's fate
    for r, r0 in zip(rows, before):
        assert torch.equal(r, r0)


def test_the_copier_says_where_it_stands_inside_a_slow_copy():
    """A copy function that blocks until released: meanwhile the copier's state says it is in its job and inside
    the driver's call, and for how long; once released the number lands and the state keeps the longest call."""
    lib = library()
    mb = torch.zeros(BUS_RING + BUS_SLOTS, dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32)
    rows, src = stage(), blocks(3, 4)
    release = threading.Event()

    def slow_copy(dst, from_, n, stream):
        release.wait(30)
        ctypes.memmove(dst, from_, n)
        return 0

    copy = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)(slow_copy)
    bus = lib.lt_bus_start(mb.data_ptr(), 1, ctypes.cast(copy, ctypes.c_void_p).value, None, None, None,
                           flag.data_ptr())
    try:
        for which in range(3):
            assert lib.lt_bus_src(bus, 0, which, src[which].data_ptr(), 3, src[which][0].numel()) == 0
            r = rows[which].cpu()
            rows = rows[:which] + (r,) + rows[which + 1:]
            assert lib.lt_bus_dst(bus, which, r.data_ptr(), r[0].numel(), r.shape[0]) == 0
        assert lib.lt_bus_go(bus) == 0
        idle = copier_state(lib, bus)
        assert idle["seen"] == 0 and idle["job_ms"] is None and idle["copy_ms"] is None
        mb[BUS_LAYER], mb[BUS_N], mb[BUS_IDS] = 0, 1, 2
        mb[BUS_SEQ] = 1
        deadline = time.monotonic() + 10
        while (st := copier_state(lib, bus))["copy_ms"] is None or st["copy_ms"] < 50:
            assert time.monotonic() < deadline, st
            time.sleep(0.01)
        assert st["seen"] == 1 and st["job_ms"] >= st["copy_ms"] >= 50
        assert "inside the driver's copy call for" in describe_copier(st)
        watched = SimpleNamespace(state=lambda: copier_state(lib, bus))  # HostBus.state over this copier
        assert "inside the driver's copy call" in stall_report(None, [watched], 0.05)
        assert stall_report(None, [watched], 60.0) is None
        release.set()
        while int(flag[0]) != 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        while (done := copier_state(lib, bus))["job_ms"] is not None:
            time.sleep(0.001)
        assert done["copy_ms"] is None and done["longest_copy_ms"] >= 50 and done["seen"] == 1
        assert "looking at the mailbox" in describe_copier(done)
        assert stall_report(None, [watched], 0.0) is None  # looking at the mailbox is not standing still
        assert torch.equal(rows[0][0], src[0][2])
    finally:
        release.set()
        lib.lt_bus_stop(bus)


def test_more_experts_than_rows_are_refused_on_the_host():
    b = HostBus([blocks(4, 2)], stage(rows=2), device=DEVICE)
    try:
        assert b.rows == 2
        with pytest.raises(ValueError, match="0 to 2 experts"):
            b.fetch(0, [0, 1, 2])
    finally:
        b.close()


def test_bad_stages_and_blocks_are_refused():
    with pytest.raises(ConfigError, match="three stage tensors"):
        HostBus([blocks(4, 2)], stage()[:2], device=DEVICE)
    small = (torch.zeros(4, 5, 18, dtype=torch.uint8, device=DEVICE),) * 2 + (
        torch.zeros(4, 3, 30, dtype=torch.uint8, device=DEVICE),)
    with pytest.raises(ConfigError, match="expert shape"):
        HostBus([blocks(4, 2)], small, device=DEVICE)
    with pytest.raises(ConfigError, match="expert shape"):
        HostBus([blocks(4, 2, shapes=SHAPES[:2] + ((3, 17),))], stage(), device=DEVICE)
    with pytest.raises(ConfigError, match="gate, up, down"):
        HostBus([blocks(4, 2)[:2]], stage(), device=DEVICE)
    with pytest.raises(ConfigError, match="at least one|layers"):
        HostBus([], stage(), device=DEVICE)


def test_close_twice_and_jobs_after_close():
    b = HostBus([blocks(4, 2)], stage(), device=DEVICE)
    b.fetch(0, [1])
    b.wait()
    b.close()
    b.close()
    assert b.jobs == 0


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the device's wait is a CUDA launch")
@pytest.mark.parametrize("status,text", [(0, "did not land"), (-1, "did not land"), (2, "out of range")])
def test_cuda_device_wait_gives_up_once_and_keeps_the_first_failure(bus, status, text):
    """A number that never lands: with the status word clear the wait spins to its bound and marks -1; with it
    already set (an earlier wait gave up, or a job failed) it gives up at its first look at the word, so a dead
    copier costs a step one bound, not one a cold layer, and the first failure's word is kept for the host."""
    from engine.kernels import host_share_triton
    from engine.kernels.host_experts import BUS_STATUS
    b, _, _ = bus
    b.seq.fill_(5)  # published, and no job will land it
    b.mailbox[BUS_STATUS] = status
    # set: 2**30 loads would take minutes, a look at the status comes every few thousand
    spins = 1 << 14 if status == 0 else 1 << 30
    host_share_triton._bus_wait_kernel[(1,)](b.flag, b.seq, b.mailbox_dev, SPINS=spins, BUS_STATUS=BUS_STATUS,
                                             num_warps=1)
    torch.cuda.synchronize()
    assert int(b.mailbox[BUS_STATUS]) == (status or -1) and int(b.flag) == 0
    with pytest.raises(HostShareError, match=text):
        b.check()
