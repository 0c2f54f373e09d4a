"""A share of the cold experts computed by CPU threads beside the bus (``HybridExperts.set_cpu_share``,
``engine.kernels.host_experts``), with ``cold_device="gpu"``.

On the CPU the "device" is the CPU: the mailbox is written and read by torch, and the native threads
compute their pairs from the same host blocks the device tier reads. The logits must follow the
placement without a share: to summation order with float32 activations, to the rounding of the activations
to 8 bits with int8 ones; on CUDA the captured step with the device's publish and collect launches, and a
pool that does not answer reported, not hung. Then cold experts fetched and warmed ahead of a layer's router
(``set_cold_prefetch``, ``begin_layer``): the predictors' scale, the settings refused, the hook every layer
calls, and on CUDA the captured step with them following the one without."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are decorated

from engine.errors import ConfigError  # noqa: E402
from engine.gguf.reader import GGUFFile  # noqa: E402
from engine.hybrid import (AHEAD_ROUTE_ENV, COLD_AHEAD_ENV, COLD_PREFETCH_ENV, FETCH_COPIER_ENV,  # noqa: E402
                           FETCH_PROGRAMS_DEFAULT, FETCH_PROGRAMS_ENV, FETCH_PROGRAMS_MAX, PREFETCH_MAX, WARM_MAX,
                           attach_hybrid)
from engine.kernels import host_experts  # noqa: E402
from engine.kernels.host_experts import HostShareError  # noqa: E402
from engine.model.qwen35moe import Qwen35MoE  # noqa: E402
from engine.model.weights import raw_experts  # noqa: E402
from engine.placement import MB  # noqa: E402
from tests.engine.steps import follow_captured  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", params=["q4_0", "q8_0"])
def qfile(request, tmp_path_factory):
    from engine.gguf.make_model import make_model

    return make_model(tmp_path_factory.mktemp("cpu_share") / f"tiny_{request.param}.gguf", "tiny", n_expert=16,
                      quant=request.param, router_skew=1.0, seed=7)


def load(path, device="cpu", quantized=False):
    with GGUFFile(path) as f:
        return Qwen35MoE.from_gguf(f, device=device, dtype=torch.float32, quantized=quantized)


def attach(path, share, device="cpu", fraction=0.5, cold_device="gpu", quantized=False, **options):
    model = load(path, device, quantized)
    with GGUFFile(path) as f:
        budget = fraction * sum(r.data.nbytes for layer in raw_experts(f, model.cfg) for r in layer) / MB
    hybrid = attach_hybrid(model, budget, None, threads=2, cold_format="quantized", hot_format="quantized",
                           gguf_file=GGUFFile(path), cold_dtype=torch.float32, cold_device=cold_device,
                           cpu_share=share, **options)
    return model, hybrid


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def run(model, ids, decode=4):
    state = model.new_state(len(ids) + decode)
    prompt = model.forward(ids[:len(ids) - decode], state, logits="all").logits
    steps = [model.forward(ids[i:i + 1], state, logits="last").logits for i in range(len(ids) - decode, len(ids))]
    return prompt, torch.cat(steps)


@pytest.mark.parametrize("int8,bound", [(False, 1e-5), (True, 0.1)])
def test_the_threads_compute_their_share_and_the_logits_follow(qfile, int8, bound):
    """A 7-token prompt (14 pairs, within the mailbox: the threads take part) and 4 single tokens. With 8-bit
    activations the kernels' own tests hold them to the rounded reference; here the rounding runs through
    eight layers of a random model (and can change a near-tied expert choice): a few percent of the logits'
    range."""
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(2))
    model, bus = attach(qfile, 0.0)
    ref = run(model, ids)
    bus.close()
    model, shared = attach(qfile, 0.5, cpu_int8=int8)
    out = run(model, ids)
    jobs = shared._host_share.jobs
    assert shared._host_share.int8 == int8
    snap = shared.stats_snapshot()
    shared.close()
    assert jobs >= 5 * model.cfg.n_layers  # every layer of every call had CPU experts to offer
    assert snap.cold_cpu_share == 0.5 and snap.cold_hits > 0
    errs = [rel_err(a, b) for a, b in zip(out, ref)]
    assert max(errs) < bound
    if int8:
        assert max(errs) > 1e-5  # the activations were rounded: not the float32 path


def test_each_layer_hands_the_share_of_its_cold_experts_and_never_a_hot_one(qfile):
    _, hybrid = attach(qfile, 0.5)
    try:
        for i, layer in enumerate(hybrid._layers):
            mine = layer.mine.bool()
            cold = ~layer.host_hot
            assert not bool((mine & layer.host_hot).any())
            mass = hybrid.stats.counts[i]
            share = float(mass[mine].sum() / mass[cold].sum())
            assert abs(share - 0.5) <= float(mass[cold].max() / mass[cold].sum())  # to one expert
            assert torch.equal(layer.bus_cold_of >= 0, cold & ~mine)
        hybrid.set_cpu_share(1.0)
        assert all(torch.equal(layer.mine.bool(), ~layer.host_hot) for layer in hybrid._layers)
        assert all(bool((layer.bus_cold_of < 0).all()) for layer in hybrid._layers)
        hybrid.set_budget(hybrid.placement.budget_mb * 1.5)  # a new placement: the share is assigned again
        assert all(torch.equal(layer.mine.bool(), ~layer.host_hot) for layer in hybrid._layers)
        hybrid.set_cpu_share(0.0)
        assert all(layer.n_mine == 0 for layer in hybrid._layers)
    finally:
        hybrid.close()


def test_bad_shares_are_refused(qfile, monkeypatch):
    with pytest.raises(ConfigError, match="between 0 and 1"):
        attach(qfile, 1.5)
    monkeypatch.setenv("LUCE_TUNE_COLD_CPU_INT8", "yes")
    with pytest.raises(ConfigError, match="LUCE_TUNE_COLD_CPU_INT8 must be 0 or 1, got 'yes'"):
        attach(qfile, 0.5)
    monkeypatch.delenv("LUCE_TUNE_COLD_CPU_INT8")
    with pytest.raises(ConfigError, match="needs cold_device='gpu'"):
        attach(qfile, 0.5, cold_device="cpu")


def test_a_failed_job_is_raised_by_the_next_check(qfile):
    model, hybrid = attach(qfile, 0.5)
    try:
        hybrid._host_share.reply[1] = 2  # what a thread writes for a job it cannot run
        with pytest.raises(HostShareError, match="more tokens or pairs"):
            hybrid.stats_snapshot()
    finally:
        hybrid.close()


def test_engine_and_cli_take_the_share(qfile, capsys):
    from engine.engine import Engine
    from tuner.cli import main

    with pytest.raises(ConfigError, match="cold_cpu_share needs cold_device='gpu'"):
        Engine.from_gguf(qfile, device="cpu", expert_budget_mb=0, cold_cpu_share=0.5)
    prompt = [3, 17, 5, 99, 42, 7]
    options = dict(device="cpu", expert_budget_mb=0, cold_device="gpu", cold_format="quantized", hot_format="quantized")
    plain = Engine.from_gguf(qfile, **options)
    shared = Engine.from_gguf(qfile, cold_cpu_share=0.5, cold_cpu_int8=False, **options)
    a, b = shared.generate(prompt, 6), plain.generate(prompt, 6)
    assert a.ids == b.ids and a.timings.extra["cold_cpu_share"] == 0.5
    assert not shared.hybrid._host_share.int8
    shared.set_cold_cpu_share(0.5, int8=True)  # the threads restart in 8 bits
    assert shared.hybrid._host_share.int8 and len(shared.generate(prompt, 6).ids) == 6
    pool = shared.hybrid._host_share
    shared.set_cold_cpu_share(0.5, threads=3)  # a new thread count restarts them, the same one keeps them
    assert shared.hybrid._host_share is not pool and shared.hybrid._host_share.threads == 3
    pool = shared.hybrid._host_share
    shared.set_cold_cpu_share(0.4, threads=3)
    assert shared.hybrid._host_share is pool and shared.generate(prompt, 6).ids == b.ids
    with pytest.raises(ConfigError, match="at least one thread, got 0"):
        shared.set_cold_cpu_share(0.5, threads=0)
    plain.hybrid.close()
    shared.hybrid.close()
    default = Engine.from_gguf(qfile, cold_cpu_share=0.5, **options)
    assert default.hybrid._host_share.int8  # 8-bit activations unless asked otherwise
    default.hybrid.close()
    status = main(["generate", "--model", str(qfile), "--prompt", "hi", "--device", "cpu", "--cold-cpu-share", "0.5"])
    assert status == 2 and "--cold-cpu-share needs --cold-device gpu" in capsys.readouterr().err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("int8,bound", [(False, 1e-3), (True, 0.1)])
@pytest.mark.parametrize("staged", [False, True], ids=["apart", "staged"])
def test_cuda_captured_step_with_the_threads_follows_the_device_model(qfile, int8, bound, staged, monkeypatch):
    """Half the experts cold, half of those computed by the threads: the step is captured with the publish
    and collect launches, and its logits follow the all-on-device model's, teacher-forced (with 8-bit
    activations, to their rounding: see the CPU test). ``staged``: quantized projections and shared expert,
    so each layer takes the five launches of ``HybridExperts._staged_moe`` (the split launch publishing the
    threads' share of each call's cold pairs, the collect launch adding it)."""
    import engine.hybrid as hybrid_module

    taken = []
    real = hybrid_module.HybridExperts._staged_moe
    monkeypatch.setattr(hybrid_module.HybridExperts, "_staged_moe",
                        lambda self, *a: (lambda out: taken.append(out is not None) or out)(real(self, *a)))
    plain = load(qfile, "cuda", quantized=staged)
    model, hybrid = attach(qfile, 0.5, device="cuda", cpu_int8=int8, quantized=staged)
    assert hybrid.graph_safe and sum(layer.n_mine for layer in hybrid._layers) > 0
    before = []
    follow_captured(plain, model, bound, before=lambda: before.append(hybrid._host_share.jobs))
    torch.cuda.synchronize()
    jobs = hybrid._host_share.jobs - before[0]
    # staged: a job only for a call with a cold pair for the threads (the share of each call's cold pairs)
    assert jobs > 0 if staged else jobs >= 12 * model.cfg.n_layers
    assert any(taken) == staged
    hybrid.check_cpu_share()
    hybrid.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_wait_for_stopped_threads_ends_and_is_reported(qfile, monkeypatch):
    monkeypatch.setattr(host_experts, "TIMEOUT_SPINS", 1 << 12)
    model, hybrid = attach(qfile, 1.0, device="cuda")
    share = hybrid._host_share
    share._lib.lt_stop(share._pool)  # the threads are gone: no reply will come
    share._pool = None
    state = model.new_state(4)
    model.forward(torch.tensor([5], device="cuda"), state, logits="last")
    torch.cuda.synchronize()  # returns: the device's wait is bounded
    with pytest.raises(HostShareError, match="did not answer"):
        hybrid.check_cpu_share()
    hybrid.close()


# Cold experts fetched and warmed ahead of a layer's router (``HybridExperts.set_cold_prefetch``, ``begin_layer``)

def test_predictors_give_the_routing_of_the_residual_without_the_mixer(qfile):
    """The predictor (the router with ``post / attn`` folded into its columns) on ``x`` (the mixer's normed input)
    routes as the router on ``rms_norm(h) * post`` does: exactly the layer's routing had the mixer added nothing."""
    model, hybrid = attach(qfile, 0.0)
    try:
        k = model.cfg.n_expert_used
        g = torch.Generator().manual_seed(1)
        for i, layer in enumerate(model.weights.layers):
            h = torch.randn(5, model.cfg.hidden, generator=g)
            x = F.rms_norm(h, (h.shape[-1],), layer.attn_norm.float(), model.cfg.rms_eps)
            router = layer.moe.router.float()
            want = (F.rms_norm(h, (h.shape[-1],), layer.post_norm.float(), model.cfg.rms_eps) @ router.T).topk(k).indices
            got = (x @ hybrid._predictors[i].T).topk(k).indices
            assert torch.equal(got, want), f"layer {i}"
    finally:
        hybrid.close()


def test_ahead_predictors_give_the_routing_from_the_layer_before(qfile):
    """A layer's predictor from the layer before's mixer input ``x = rms_norm(h) * attn[i - 1]`` routes as
    ``rms_norm(h) * post[i]`` does: the layer's routing had neither mixer nor the experts between added
    anything."""
    model, hybrid = attach(qfile, 0.0)
    try:
        k, layers = model.cfg.n_expert_used, model.weights.layers
        g = torch.Generator().manual_seed(3)
        assert hybrid._ahead_predictors[0] is None and len(hybrid._ahead_predictors) == len(layers)
        for i in range(1, len(layers)):
            h = torch.randn(5, model.cfg.hidden, generator=g)
            x = F.rms_norm(h, (h.shape[-1],), layers[i - 1].attn_norm.float(), model.cfg.rms_eps)
            router = layers[i].moe.router.float()
            want = (F.rms_norm(h, (h.shape[-1],), layers[i].post_norm.float(), model.cfg.rms_eps)
                    @ router.T).topk(k).indices
            assert torch.equal((x @ hybrid._ahead_predictors[i].T).topk(k).indices, want), f"layer {i}"
    finally:
        hybrid.close()


def test_the_layer_before_a_cold_one_fetches_for_it(qfile):
    """``prefetch_target``: with ``cold_ahead`` a layer whose experts are all hot fetches for the next layer
    where that one took the staged path; otherwise a layer fetches for itself where it took it, and a hot
    layer before a hot one, or any layer without ``cold_ahead``, only for itself."""
    model, hybrid = attach(qfile, 0.0, unit="alternate")
    try:
        n = len(model.weights.layers)
        all_hot = [layer.n_hot == layer.n_expert for layer in hybrid._layers]
        assert any(all_hot) and not all(all_hot)  # half the experts by whole layers, every other one first
        assert all_hot[n - 1] and not all_hot[n - 2]
        cold = [i for i in range(n) if not all_hot[i]]
        hybrid._two_streams = [not hot for hot in all_hot]  # as after a step: the cold layers took two streams
        assert hybrid.cold_ahead
        for i in range(n):
            if all_hot[i]:
                assert hybrid.prefetch_target(i) == (i + 1 if i + 1 in cold else None), f"layer {i}"
            else:
                assert hybrid.prefetch_target(i) == i, f"layer {i}"
        hybrid.set_cold_prefetch(1, ahead=False)
        assert [hybrid.prefetch_target(i) for i in range(n)] == [i if i in cold else None for i in range(n)]
        hybrid._two_streams = [False] * n
        hybrid.set_cold_prefetch(1, ahead=True)
        assert all(hybrid.prefetch_target(i) is None for i in range(n))
    finally:
        hybrid.close()


def test_bad_prefetch_counts_are_refused(qfile, monkeypatch):
    model, hybrid = attach(qfile, 0.0)
    try:
        for bad in (-1, PREFETCH_MAX + 1, 1.5):
            with pytest.raises(ConfigError, match="fetched ahead"):
                hybrid.set_cold_prefetch(bad)
        for bad in (-1, WARM_MAX + 1, 1.5):
            with pytest.raises(ConfigError, match="warmed ahead"):
                hybrid.set_cold_prefetch(1, warm=bad)
        with pytest.raises(ConfigError, match="cold_ahead"):
            hybrid.set_cold_prefetch(1, ahead=1)
        for bad in ("gpu", 1):
            with pytest.raises(ConfigError, match="predicting router"):
                hybrid.set_cold_prefetch(1, route=bad)
        for bad in (-1, FETCH_PROGRAMS_MAX + 1, 2.0, True):
            with pytest.raises(ConfigError, match="fetch's programs"):
                hybrid.set_cold_prefetch(1, programs=bad)
        for bad in ("dma", 1, None.__class__):
            with pytest.raises(ConfigError, match="fetch's copier"):
                hybrid.set_cold_prefetch(1, copier=bad)
        assert hybrid.ahead_route == "main" and hybrid.fetch_programs == FETCH_PROGRAMS_DEFAULT == 8  # the defaults
        assert hybrid.fetch_copier == "kernel"
        hybrid.set_cold_prefetch(1, copier="engine")
        assert hybrid.fetch_copier == "engine" and hybrid.fetch_programs == 8
        hybrid.set_cold_prefetch(1, route="side", programs=16)
        assert hybrid.ahead_route == "side" and hybrid.fetch_programs == 16
        hybrid.set_cold_prefetch(1, programs=0)
        assert hybrid.ahead_route == "side" and hybrid.fetch_programs is None
        hybrid.set_cold_prefetch(2, warm=WARM_MAX)
        assert hybrid.cold_prefetch == 2 and hybrid.stats_snapshot().cold_prefetch == 2
        assert hybrid.cold_warm == WARM_MAX
    finally:
        hybrid.close()
    monkeypatch.setenv(COLD_PREFETCH_ENV, "9")
    with pytest.raises(ConfigError, match=COLD_PREFETCH_ENV):
        attach(qfile, 0.0)
    monkeypatch.delenv(COLD_PREFETCH_ENV)
    for name, bad in ((AHEAD_ROUTE_ENV, "gpu"), (FETCH_PROGRAMS_ENV, "-3"), (FETCH_PROGRAMS_ENV, "2000"),
                      (FETCH_COPIER_ENV, "dma")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match=name):
            attach(qfile, 0.0)
        monkeypatch.delenv(name)
    monkeypatch.setenv(AHEAD_ROUTE_ENV, "side")
    monkeypatch.setenv(FETCH_PROGRAMS_ENV, "12")
    monkeypatch.setenv(FETCH_COPIER_ENV, "engine")
    _, hybrid = attach(qfile, 0.0)
    try:
        assert hybrid.ahead_route == "side" and hybrid.fetch_programs == 12 and hybrid.fetch_copier == "engine"
    finally:
        hybrid.close()
    monkeypatch.setenv(FETCH_PROGRAMS_ENV, "0")  # one program a block
    _, hybrid = attach(qfile, 0.0)
    try:
        assert hybrid.fetch_programs is None
    finally:
        hybrid.close()
    monkeypatch.setenv(COLD_AHEAD_ENV, "yes")
    with pytest.raises(ConfigError, match=COLD_AHEAD_ENV):
        attach(qfile, 0.0)


def test_every_layer_starts_with_the_executors_hook(qfile):
    """``run_layers`` hands an executor with ``begin_layer`` each layer's index and mixer input, in order; on
    the CPU the hybrid executor's hook fetches nothing and the logits are the same with it set."""
    model, hybrid = attach(qfile, 0.0)
    try:
        ids = torch.tensor([3, 9, 27, 81])
        ref = model.forward(ids, model.new_state(8)).logits
        seen = []
        real = hybrid.begin_layer
        hybrid.begin_layer = lambda i, x: seen.append((i, tuple(x.shape))) or real(i, x)
        hybrid.set_cold_prefetch(2)
        out = model.forward(ids, model.new_state(8)).logits
        assert seen == [(i, (4, model.cfg.hidden)) for i in range(model.cfg.n_layers)]
        assert torch.equal(out, ref)
        assert hybrid.stats_snapshot().prefetched == 0
    finally:
        hybrid.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fetch,warm,unit,route,programs,copier", [
    (1, 0, "expert", "main", 0, "kernel"), (2, 0, "expert", "side", 0, "kernel"),
    (PREFETCH_MAX, 0, "expert", "main", 0, "kernel"), (0, 1, "expert", "main", 0, "kernel"),
    (1, 1, "expert", "side", 0, "kernel"), (1, 1, "alternate", "main", 0, "kernel"),
    (1, 1, "alternate", "side", 0, "kernel"), (2, 2, "alternate", "main", 3, "kernel"),
    (0, WARM_MAX, "alternate", "main", 0, "kernel"), (PREFETCH_MAX, 4, "alternate", "main", 0, "kernel"),
    (PREFETCH_MAX, 4, "alternate", "side", 5, "kernel"), (1, 6, "alternate", "main", 8, "kernel"),
    (1, 6, "alternate", "main", 8, "engine"), (2, 0, "expert", "side", 0, "engine"),
    (2, 5, "alternate", "main", 8, "engine"), (PREFETCH_MAX, 4, "alternate", "side", 0, "engine")])
def test_cuda_captured_step_with_fetches_follows_the_device_model(qfile, fetch, warm, unit, route, programs, copier):
    """Half the experts cold, half of those on the threads (float32 activations), ``fetch`` cold experts a
    layer fetched ahead by the bus and ``warm`` more warmed by the threads: the captured step follows the
    all-on-device model teacher-forced, as it does without them, and they served pairs (the tiny random
    model routes alike before and after its mixers); the threads fetched chunks for the warm-ups. With
    placement ``"alternate"`` each cold layer but the first is predicted at the hot layer before it. The
    predicting router on the step's stream or the second one, the fetch in one program a block or a few
    looping, or by the copy engine from the copier's thread (which then queued a fetch a cold layer a step)."""
    plain = load(qfile, "cuda", quantized=True)
    model, hybrid = attach(qfile, 0.5, device="cuda", quantized=True, cpu_int8=False, cold_prefetch=fetch,
                           cold_warm=warm, unit=unit)
    hybrid.set_cold_prefetch(fetch, route=route, programs=programs, copier=copier)
    try:
        follow_captured(plain, model, 1e-3, before=hybrid.reset_counters)
        if copier == "engine":
            assert len(hybrid._buses) == 1
            bus = next(iter(hybrid._buses.values()))
            assert bus.jobs > 0 and bus.jobs == int(bus.seq) == int(bus.flag)
        stats = hybrid.stats_snapshot()
        assert 0 < stats.prefetch_served <= stats.cold_hits
        assert 0 < stats.prefetched <= 12 * (fetch + warm) * model.cfg.n_layers
        if unit == "alternate":
            sent = hybrid._fetch_sent.tolist()
            hot = [layer.n_hot == layer.n_expert for layer in hybrid._layers]
            assert all(sent[i] == 0 for i in range(len(hot)) if hot[i]) and any(sent)
            assert [hybrid.prefetch_target(i) for i in range(len(hot)) if hot[i] and i + 1 < len(hot)] == [
                i + 1 for i in range(len(hot) - 1) if hot[i] and not hot[i + 1]]
        if warm and fetch < model.cfg.n_expert_used:  # else the fetch takes every predicted expert: none is warmed
            assert hybrid._host_share.warm_chunks > 0 and int(hybrid._host_share.warm_seq) > 0
        hybrid.check_cpu_share()
    finally:
        hybrid.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("copier", ["kernel", "engine"])
def test_cuda_captured_step_with_warm_ups_ahead_follows_the_device_model(qfile, copier, monkeypatch):
    """The pool built to warm each layer's experts ahead of its warm-up (``-DLT_SPEC=1``): the captured step
    still follows the all-on-device model teacher-forced, and the threads fetched chunks ahead (the tiny model's
    routing repeats over tokens enough for the layer's last warm-up to name experts again)."""
    from engine.kernels.host_experts import CFLAGS_ENV

    monkeypatch.setenv(CFLAGS_ENV, "-DLT_SPEC=1")
    plain = load(qfile, "cuda", quantized=True)
    model, hybrid = attach(qfile, 0.5, device="cuda", quantized=True, cpu_int8=False, cold_prefetch=1,
                           cold_warm=4, unit="alternate")
    hybrid.set_cold_prefetch(1, route="main", programs=8, copier=copier)
    try:
        follow_captured(plain, model, 1e-3, before=hybrid.reset_counters)
        share = hybrid._host_share
        assert share.spec_chunks is not None and share.spec_chunks > 0 and share.warm_chunks > 0
        hybrid.check_cpu_share()
    finally:
        hybrid.close()


def test_engine_and_cli_take_the_count(qfile, capsys):
    """``Engine.from_gguf(cold_prefetch=)`` and ``set_cold_prefetch`` reach the executor and its stats; the CLI
    refuses ``--cold-prefetch`` without a CPU share, and the engine without a budget on the GPU tier."""
    from engine.engine import Engine
    from tuner.cli import main

    with pytest.raises(ConfigError, match="cold_prefetch and cold_warm need cold_device='gpu'"):
        Engine.from_gguf(qfile, device="cpu", expert_budget_mb=0, cold_warm=1)
    options = dict(device="cpu", expert_budget_mb=0, cold_device="gpu", cold_format="quantized", hot_format="quantized")
    eng = Engine.from_gguf(qfile, cold_cpu_share=0.5, cold_prefetch=2, cold_warm=1, **options)
    try:
        out = eng.generate([3, 17, 5], 4)
        assert eng.hybrid.cold_prefetch == 2 and out.timings.extra["cold_prefetch"] == 2
        assert out.timings.extra["cold_warm"] == 1
        eng.set_cold_prefetch(0)  # the warm count as set
        assert eng.hybrid.cold_prefetch == 0 and eng.hybrid.cold_warm == 1
        eng.set_cold_prefetch(0, route="side", programs=4, copier="engine")  # every setting reaches the executor
        assert (eng.hybrid.ahead_route, eng.hybrid.fetch_programs, eng.hybrid.fetch_copier) == ("side", 4, "engine")
        with pytest.raises(ConfigError, match="fetch's copier"):
            eng.set_cold_prefetch(0, copier="dma")
        assert eng.generate([3, 17, 5], 4).ids == out.ids
        with pytest.raises(ConfigError, match="fetched ahead"):
            eng.set_cold_prefetch(PREFETCH_MAX + 1)
    finally:
        eng.hybrid.close()
    status = main(["generate", "--model", str(qfile), "--prompt", "hi", "--device", "cpu", "--cold-prefetch", "1"])
    assert status == 2 and "--cold-prefetch and --cold-warm need --cold-cpu-share" in capsys.readouterr().err
