"""Cold experts fetched ahead of a layer's router (``HybridExperts.set_cold_prefetch``, ``begin_layer``): the
predictors' scale, the settings refused, the hook every layer calls, and on CUDA the captured step with the
fetches following the one without them."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are decorated

from engine.errors import ConfigError  # noqa: E402
from engine.gguf.reader import GGUFFile  # noqa: E402
from engine.hybrid import COLD_PREFETCH_ENV, PREFETCH_MAX, attach_hybrid  # noqa: E402
from engine.model.decode_graph import DecodeGraph  # noqa: E402
from engine.model.qwen35moe import Qwen35MoE  # noqa: E402
from engine.model.weights import raw_experts  # noqa: E402
from engine.placement import MB  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def qfile(tmp_path_factory):
    from engine.gguf.make_model import make_model

    return make_model(tmp_path_factory.mktemp("prefetch") / "tiny_q4_0.gguf", "tiny", n_expert=16, quant="q4_0",
                      router_skew=1.0, seed=5)


def load(path, device="cpu", quantized=False):
    with GGUFFile(path) as f:
        return Qwen35MoE.from_gguf(f, device=device, dtype=torch.float32, quantized=quantized)


def attach(path, share, device="cpu", quantized=False, **options):
    model = load(path, device, quantized)
    with GGUFFile(path) as f:
        budget = 0.5 * sum(r.data.nbytes for layer in raw_experts(f, model.cfg) for r in layer) / MB
    hybrid = attach_hybrid(model, budget, None, threads=2, cold_format="quantized", hot_format="quantized",
                           gguf_file=GGUFFile(path), cold_dtype=torch.float32, cold_device="gpu", cpu_share=share,
                           **options)
    return model, hybrid


def test_predictors_give_the_routing_of_the_residual_without_the_mixer(qfile):
    """The predictor's input ``x * post / attn`` (x the mixer's normed input) routes as ``rms_norm(h) * post``
    does: exactly the layer's routing had the mixer added nothing."""
    model, hybrid = attach(qfile, 0.0)
    try:
        k = model.cfg.n_expert_used
        g = torch.Generator().manual_seed(1)
        for i, layer in enumerate(model.weights.layers):
            h = torch.randn(5, model.cfg.hidden, generator=g)
            x = F.rms_norm(h, (h.shape[-1],), layer.attn_norm.float(), model.cfg.rms_eps)
            router, scale = hybrid._predictors[i]
            want = (F.rms_norm(h, (h.shape[-1],), layer.post_norm.float(), model.cfg.rms_eps) @ router.T).topk(k).indices
            got = ((x * scale) @ router.T).topk(k).indices
            assert torch.equal(got, want), f"layer {i}"
    finally:
        hybrid.close()


def test_bad_prefetch_counts_are_refused(qfile, monkeypatch):
    model, hybrid = attach(qfile, 0.0)
    try:
        for bad in (-1, PREFETCH_MAX + 1, 1.5):
            with pytest.raises(ConfigError, match="fetched ahead"):
                hybrid.set_cold_prefetch(bad)
            with pytest.raises(ConfigError, match="warmed ahead"):
                hybrid.set_cold_prefetch(1, warm=bad)
        hybrid.set_cold_prefetch(2)
        assert hybrid.cold_prefetch == 2 and hybrid.stats_snapshot().cold_prefetch == 2
    finally:
        hybrid.close()
    monkeypatch.setenv(COLD_PREFETCH_ENV, "9")
    with pytest.raises(ConfigError, match=COLD_PREFETCH_ENV):
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


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fetch,warm", [(1, 0), (2, 0), (PREFETCH_MAX, 0), (0, 1), (1, 1)])
def test_cuda_captured_step_with_fetches_follows_the_device_model(qfile, fetch, warm):
    """Half the experts cold, half of those on the threads (float32 activations), ``fetch`` cold experts a
    layer fetched ahead by the bus and ``warm`` more warmed by the threads: the captured step follows the
    all-on-device model teacher-forced, as it does without them, and they served pairs (the tiny random
    model routes alike before and after its mixers); the threads fetched chunks for the warm-ups."""
    plain = load(qfile, "cuda", quantized=True)
    model, hybrid = attach(qfile, 0.5, device="cuda", quantized=True, cpu_int8=False, cold_prefetch=fetch,
                           cold_warm=warm)
    try:
        ids = torch.randint(0, 256, (7 + 12,), generator=torch.Generator().manual_seed(6)).cuda()
        eager, static = plain.new_state(24), model.new_state(24)
        plain.forward(ids[:7], eager, logits="none")
        model.forward(ids[:7], static, logits="none")
        step = DecodeGraph(model, static, graph=True)
        assert step.captured
        hybrid.reset_counters()
        for t in range(7, 19):
            ref = plain.forward(ids[t:t + 1], eager, logits="last").logits
            assert rel_err(step.step(ids[t:t + 1]), ref) < 1e-3, f"token {t}"
        stats = hybrid.stats_snapshot()
        assert 0 < stats.prefetch_served <= stats.cold_hits
        assert 0 < stats.prefetched <= 12 * (fetch + warm) * model.cfg.n_layers
        if warm:
            assert hybrid._host_share.warm_chunks > 0 and int(hybrid._host_share.warm_seq) > 0
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
        assert eng.generate([3, 17, 5], 4).ids == out.ids
        with pytest.raises(ConfigError, match="fetched ahead"):
            eng.set_cold_prefetch(PREFETCH_MAX + 1)
    finally:
        eng.hybrid.close()
    status = main(["generate", "--model", str(qfile), "--prompt", "hi", "--device", "cpu", "--cold-prefetch", "1"])
    assert status == 2 and "--cold-prefetch and --cold-warm need --cold-cpu-share" in capsys.readouterr().err
