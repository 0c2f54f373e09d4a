"""The hybrid executor with ``cold_format="quantized"`` on a tiny Q4_0 model: cold experts held
as GGUF blocks and multiplied by torch's CPU weight-only kernels, hot ones dequantized into
device slots.

Bounds, relative to the largest dense-path value (per token for logits):
- cold tier in float32 (the kernels' exact path): logits within 1e-5, as the dense hybrid
  itself (the Q4_0 mapping is exact; only the order of sums differs).
- cold tier in bfloat16 (the fast path): one layer's routed output within 2e-2 under the same
  routing (activations, scales and outputs rounded to bfloat16, 2**-9 relative each; about 4e-3
  measured). Logits: the median token within 1e-2 (about 4e-3 measured); a token whose router
  has a near-tie may pick another expert downstream and differ by more (0-2 tokens in 11 seen).
- every expert hot: identical to the dense path (slots hold the same dequantized values).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are decorated

from engine.errors import ConfigError  # noqa: E402
from engine.gguf import quants  # noqa: E402
from engine.gguf.reader import GGUFFile  # noqa: E402
from engine.hybrid import attach_hybrid  # noqa: E402
from engine.model.qwen35moe import Qwen35MoE  # noqa: E402
from engine.model.weights import raw_experts  # noqa: E402
from engine.placement import MB, calibrate_routing  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def q4_model_file(tmp_path_factory):
    from engine.gguf.make_model import make_model

    return make_model(tmp_path_factory.mktemp("hybrid_q") / "tiny_q4_0.gguf", "tiny", n_expert=16, quant="q4_0",
                      router_skew=1.0, seed=5)


def load_model(path, device="cpu", dtype=None):
    with GGUFFile(path) as f:
        return Qwen35MoE.from_gguf(f, device=device, dtype=dtype)


def logits(model, ids):
    return model.forward(ids, model.new_state(len(ids)), logits="all").logits


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def full_mb(model):
    return sum(t.numel() * t.element_size() for layer in model.weights.layers
               for t in (layer.moe.experts.gate, layer.moe.experts.up, layer.moe.experts.down)) / MB


@pytest.fixture(scope="module")
def prompt_and_stats(q4_model_file):
    model = load_model(q4_model_file)
    ids = torch.randint(0, model.cfg.vocab, (11,), generator=torch.Generator().manual_seed(1))
    return ids, calibrate_routing(model, [ids.tolist()])


def dense_run(path, fraction, ids, stats, device="cpu"):
    model = load_model(path, device, torch.float32)
    hybrid = attach_hybrid(model, fraction * full_mb(model), stats, threads=2)
    out = logits(model, ids.to(device))
    snap = hybrid.stats_snapshot()
    hybrid.close()
    return out, snap


def quantized_run(path, fraction, ids, stats, cold_dtype, device="cpu"):
    model = load_model(path, device, torch.float32)
    hybrid = attach_hybrid(model, fraction * full_mb(model), stats, threads=2, cold_format="quantized",
                           gguf_file=GGUFFile(path), cold_dtype=cold_dtype)
    assert all(layer.moe.experts.gate.device.type == "meta" for layer in model.weights.layers)
    out = logits(model, ids.to(device))
    snap = hybrid.stats_snapshot()
    hybrid.close()
    return out, snap


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_quantized_cold_tier_matches_dense(q4_model_file, prompt_and_stats, fraction):
    ids, stats = prompt_and_stats
    ref, dense = dense_run(q4_model_file, fraction, ids, stats)
    exact, snap = quantized_run(q4_model_file, fraction, ids, stats, torch.float32)
    fast, fast_snap = quantized_run(q4_model_file, fraction, ids, stats, torch.bfloat16)
    assert rel_err(exact, ref) < 1e-5
    if fraction == 1.0:
        assert torch.equal(fast, ref)
    else:
        per_token = (fast - ref).abs().amax(1) / ref.abs().amax(1)
        assert 0 < per_token.median() < 1e-2 and (per_token < 1e-2).float().mean() >= 0.75
        assert fast_snap.cold_hits > 0
    assert (snap.hot_hits, snap.cold_hits) == (dense.hot_hits, dense.cold_hits)
    assert snap.expert_vram_mb == dense.expert_vram_mb
    # Q4_0 packed with bfloat16 (scale, zero) is 0.625 bytes per weight, against 4 for float32
    assert fast_snap.expert_host_mb < dense.expert_host_mb / 6
    assert dense.expert_host_mb == pytest.approx(full_mb(load_model(q4_model_file)))


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_quantized_layer_output_under_the_same_routing(q4_model_file, fraction):
    dense_model, quant_model = load_model(q4_model_file), load_model(q4_model_file)
    cfg = dense_model.cfg
    dense = attach_hybrid(dense_model, fraction * full_mb(dense_model), threads=2)
    fast = attach_hybrid(quant_model, fraction * full_mb(quant_model), threads=2, cold_format="quantized",
                         gguf_file=GGUFFile(q4_model_file))
    g = torch.Generator().manual_seed(3)
    for layer in range(cfg.n_layers):
        for T in (1, 7):
            x = torch.randn(T, cfg.hidden, generator=g)
            ids = torch.stack([torch.randperm(cfg.n_expert, generator=g)[:cfg.n_expert_used] for _ in range(T)])
            w = torch.softmax(torch.randn(T, cfg.n_expert_used, generator=g), -1)
            ref = dense(layer, x, ids, w)
            assert rel_err(fast(layer, x, ids, w), ref) < 2e-2
    assert fast.stats_snapshot().cold_hits > 0
    dense.close()
    fast.close()


@pytest.mark.parametrize("fused", [False, True])
def test_raw_experts_are_the_loaded_experts(tmp_path, fused):
    from engine.gguf.make_model import make_model

    path = make_model(tmp_path / "m.gguf", "tiny", n_layers=2, quant="q8_0", seed=2, fused_experts=fused)
    model = load_model(path)
    with GGUFFile(path) as f:
        layers = raw_experts(f, model.cfg)
        for layer, raw in zip(model.weights.layers, layers):
            ew = layer.moe.experts
            for dense, r in zip((ew.gate, ew.up, ew.down), raw):
                assert (r.rows, r.cols) == tuple(dense.shape[1:])
                for e in (0, ew.n_expert - 1):
                    assert torch.equal(quants.dequantize(r.expert(e), r.qtype, (r.rows, r.cols)), dense[e])
        del layers, raw, r


def test_engine_option(q4_model_file):
    from engine.engine import Engine

    with pytest.raises(ConfigError, match="cold_format must be 'dense' or 'quantized', got 'int4'"):
        Engine.from_gguf(q4_model_file, device="cpu", cold_format="int4")
    dense = Engine.from_gguf(q4_model_file, device="cpu", expert_budget_mb=0)
    eng = Engine.from_gguf(q4_model_file, device="cpu", expert_budget_mb=0, cold_format="quantized")
    ids = eng.tokenizer.encode("def add(a, b):")
    out, ref = eng.generate(ids, 4), dense.generate(ids, 4)
    assert len(out.ids) == 4 and out.timings.extra["cold_hits"] > 0
    assert out.timings.extra["expert_host_mb"] < ref.timings.extra["expert_host_mb"] / 6
    per_token = (eng.logits(ids) - dense.logits(ids)).abs().amax(1) / dense.logits(ids).abs().amax(1)
    assert per_token.median() < 1e-2
    eng.hybrid.close()
    dense.hybrid.close()


def test_cli_option_errors(q4_model_file, capsys):
    from tuner.cli import main

    status = main(["generate", "--model", str(q4_model_file), "--prompt", "hi", "--device", "cpu",
                   "--cold-format", "quantized"])
    assert status == 2 and "--cold-format needs --expert-budget" in capsys.readouterr().err
    status = main(["generate", "--model", str(q4_model_file), "--prompt", "hi", "--device", "cpu",
                   "--cold-format", "int4", "--expert-budget", "0"])
    assert status == 2 and "--cold-format must be dense or quantized, got 'int4'" in capsys.readouterr().err


def test_cli_generates_with_quantized_cold_tier(q4_model_file, capsys):
    import json

    from tuner.cli import main

    status = main(["generate", "--model", str(q4_model_file), "--prompt", "hi", "--device", "cpu", "-n", "3",
                   "--expert-budget", "0", "--cold-format", "quantized", "--json"])
    assert status in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert len(out["ids"]) == 3 and out["timings"]["cold_hits"] > 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_cuda_quantized_cold_tier_matches_dense(q4_model_file, prompt_and_stats, fraction):
    ids, stats = prompt_and_stats
    ref, dense = dense_run(q4_model_file, fraction, ids, stats, "cuda")
    exact, _ = quantized_run(q4_model_file, fraction, ids, stats, torch.float32, "cuda")
    fast, snap = quantized_run(q4_model_file, fraction, ids, stats, torch.bfloat16, "cuda")
    assert exact.device.type == "cuda"
    # the CPU tier's float32 sums against cuBLAS's on the device: 1.15e-5 measured at 0% on the H200
    assert rel_err(exact.cpu(), ref.cpu()) < 3e-5
    per_token = (fast - ref).abs().amax(1) / ref.abs().amax(1)
    assert per_token.max() < 1e-5 if fraction == 1.0 else per_token.median() < 1e-2
    assert snap.expert_vram_mb == dense.expert_vram_mb


def test_engine_with_a_budget_never_reads_the_dense_experts(q4_model_file):
    """With a budget and the quantized cold tier, the engine loads the routed experts as meta
    tensors (the placement builds its copies from the file), so a model larger than the GPU
    loads; its logits equal the fully loaded model's under the same placement."""
    from engine.engine import Engine

    with GGUFFile(q4_model_file) as f:
        meta = Qwen35MoE.from_gguf(f, expert_device="meta")
    ew = meta.weights.layers[0].moe.experts
    assert all(t.device.type == "meta" for t in (ew.gate, ew.up, ew.down))
    assert meta.weights.embed.device.type == "cpu" and meta.weights.layers[0].moe.router.device.type == "cpu"

    full = load_model(q4_model_file)
    budget = full_mb(full) / 2
    eng = Engine.from_gguf(q4_model_file, device="cpu", expert_budget_mb=budget, cold_format="quantized")
    for layer in eng.model.weights.layers:
        assert all(t.device.type == "meta" for t in (layer.moe.experts.gate, layer.moe.experts.up,
                                                      layer.moe.experts.down))
    ref = attach_hybrid(full, budget, None, cold_format="quantized", gguf_file=GGUFFile(q4_model_file))
    ids = torch.tensor([3, 17, 5, 99, 42, 7, 8, 1, 250, 31, 64])
    assert ref.placement.hot == eng.hybrid.placement.hot
    assert eng.hybrid.placement.hot_count > 0 and eng.hybrid.placement.cold_count > 0
    torch.testing.assert_close(logits(eng.model, ids), logits(full, ids), rtol=0, atol=0)


def quantized_mb(path):
    """Bytes of every routed expert as the file stores them (Q4_0 blocks), in MB."""
    with GGUFFile(path) as f:
        model = load_model(path)
        return sum(r.data.nbytes for layer in raw_experts(f, model.cfg) for r in layer) / MB


def quantized_hot_run(path, fraction, ids, stats, device="cpu", impl="auto"):
    model = load_model(path, device, torch.float32)
    hybrid = attach_hybrid(model, fraction * quantized_mb(path), stats, threads=2, cold_format="quantized",
                           gguf_file=GGUFFile(path), cold_dtype=torch.float32, hot_format="quantized", impl=impl)
    out = logits(model, ids.to(device))
    snap = hybrid.stats_snapshot()
    placement = hybrid.placement
    hybrid.close()
    return out, snap, placement


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_quantized_hot_tier_matches_dense(q4_model_file, prompt_and_stats, fraction):
    """Hot experts kept as Q4_0 blocks on the device: the same logits as the dense path (float32
    throughout: the blocks map exactly), and the budget counted in quantized bytes."""
    ids, stats = prompt_and_stats
    out, snap, placement = quantized_hot_run(q4_model_file, fraction, ids, stats)
    total_hot = placement.hot_count
    ref, dense = dense_run(q4_model_file, 1.0, ids, stats)
    assert rel_err(out, ref) < 1e-5
    per_expert = quantized_mb(q4_model_file) / (load_model(q4_model_file).cfg.n_layers
                                                * load_model(q4_model_file).cfg.n_expert)
    assert snap.expert_vram_mb == pytest.approx(total_hot * per_expert)
    assert snap.expert_vram_mb <= fraction * quantized_mb(q4_model_file) + 1e-9
    if fraction == 1.0:
        assert snap.cold_hits == 0 and snap.hot_experts == placement.hot_count
        # Q4_0 is 18 bytes per 32 weights against float32's 128: the whole set is 0.14 of the dense bytes
        assert snap.expert_vram_mb == pytest.approx(dense.expert_vram_mb * 18 / 128)
    elif fraction == 0.5:
        assert snap.hot_hits > 0 and snap.cold_hits > 0


def test_quantized_hot_tier_through_the_triton_kernels(q4_model_file, prompt_and_stats):
    """Every expert hot and quantized, run by the Triton quantized-expert kernel (the interpreter on
    the CPU): what a captured decode step replays."""
    ids, stats = prompt_and_stats
    out, snap, _ = quantized_hot_run(q4_model_file, 1.0, ids[:5], stats, impl="triton")
    ref, _ = dense_run(q4_model_file, 1.0, ids[:5], stats)
    assert rel_err(out, ref) < 3e-5 and snap.cold_hits == 0  # 1.4e-5 on an AMD EPYC: the kernels' own summation order


def test_quantized_hot_layer_output_under_the_same_routing(q4_model_file):
    dense_model, quant_model = load_model(q4_model_file), load_model(q4_model_file)
    cfg = dense_model.cfg
    dense = attach_hybrid(dense_model, full_mb(dense_model), threads=2)
    quant = attach_hybrid(quant_model, 0.5 * quantized_mb(q4_model_file), threads=2, cold_format="quantized",
                          gguf_file=GGUFFile(q4_model_file), cold_dtype=torch.float32, hot_format="quantized")
    assert quant.graph_safe is False  # cold experts need the host
    g = torch.Generator().manual_seed(4)
    for layer in range(cfg.n_layers):
        for T in (1, 6):
            x = torch.randn(T, cfg.hidden, generator=g)
            ids = torch.stack([torch.randperm(cfg.n_expert, generator=g)[:cfg.n_expert_used] for _ in range(T)])
            w = torch.softmax(torch.randn(T, cfg.n_expert_used, generator=g), -1)
            assert rel_err(quant(layer, x, ids, w), dense(layer, x, ids, w)) < 1e-5
    snap = quant.stats_snapshot()
    assert snap.hot_hits > 0 and snap.cold_hits > 0
    dense.close()
    quant.close()


def test_quantized_hot_tier_moves_in_place(q4_model_file, prompt_and_stats):
    """``set_budget`` between quantized budgets keeps the same logits and the byte accounting."""
    ids, stats = prompt_and_stats
    model = load_model(q4_model_file)
    total = quantized_mb(q4_model_file)
    hybrid = attach_hybrid(model, 0.0, stats, threads=2, cold_format="quantized", gguf_file=GGUFFile(q4_model_file),
                           cold_dtype=torch.float32, hot_format="quantized")
    ref = logits(model, ids)
    for fraction in (1.0, 0.3, 0.0):
        placement = hybrid.set_budget(fraction * total)
        assert rel_err(logits(model, ids), ref) < 1e-5
        assert hybrid.stats_snapshot().expert_vram_mb == pytest.approx(placement.hot_count * total
                                                                        / (model.cfg.n_layers * model.cfg.n_expert))
    hybrid.close()


def test_quantized_hot_tier_needs_the_quantized_cold_tier(q4_model_file, capsys):
    from engine.engine import Engine
    from tuner.cli import main

    model = load_model(q4_model_file)
    with pytest.raises(ConfigError, match="quantized hot experts need the quantized cold format"):
        attach_hybrid(model, 0.0, threads=2, hot_format="quantized")
    with pytest.raises(ConfigError, match="hot_format='quantized' needs cold_format='quantized'"):
        Engine.from_gguf(q4_model_file, device="cpu", expert_budget_mb=0, hot_format="quantized")
    with pytest.raises(ConfigError, match="hot_format must be 'dense' or 'quantized', got 'int4'"):
        Engine.from_gguf(q4_model_file, device="cpu", hot_format="int4")
    status = main(["generate", "--model", str(q4_model_file), "--prompt", "hi", "--device", "cpu",
                   "--expert-budget", "0", "--hot-format", "quantized"])
    assert status == 2 and "--hot-format quantized needs --cold-format quantized" in capsys.readouterr().err


def test_engine_generates_with_quantized_hot_tier(q4_model_file, capsys):
    import json

    from tuner.cli import main

    status = main(["generate", "--model", str(q4_model_file), "--prompt", "def add(a, b):", "--device", "cpu",
                   "-n", "4", "--expert-budget", f"{0.5 * quantized_mb(q4_model_file)}", "--cold-format",
                   "quantized", "--hot-format", "quantized", "--json"])
    assert status in (0, None)
    out = json.loads(capsys.readouterr().out)
    t = out["timings"]
    assert len(out["ids"]) == 4 and t["hot_hits"] > 0 and t["cold_hits"] > 0
    assert 0 < t["expert_vram_mb"] <= 0.5 * quantized_mb(q4_model_file) + 1e-9


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_cuda_quantized_hot_tier_matches_dense(q4_model_file, prompt_and_stats, fraction):
    ids, stats = prompt_and_stats
    out, snap, _ = quantized_hot_run(q4_model_file, fraction, ids, stats, "cuda")
    ref, _ = dense_run(q4_model_file, 1.0, ids, stats, "cuda")
    assert rel_err(out.cpu(), ref.cpu()) < 1e-5
    assert snap.expert_vram_mb <= fraction * quantized_mb(q4_model_file) + 1e-9


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replays_the_quantized_hot_tier(q4_model_file):
    from engine.model.decode_graph import DecodeGraph

    model, eager_model = load_model(q4_model_file, "cuda", torch.float32), load_model(q4_model_file, "cuda",
                                                                                      torch.float32)
    hybrid = attach_hybrid(model, quantized_mb(q4_model_file), threads=2, cold_format="quantized",
                           gguf_file=GGUFFile(q4_model_file), cold_dtype=torch.float32, hot_format="quantized")
    assert hybrid.graph_safe
    ids = torch.randint(0, model.cfg.vocab, (12,), generator=torch.Generator().manual_seed(6)).cuda()
    state, eager = model.new_state(16), eager_model.new_state(16)
    model.forward(ids[:8], state, logits="none")
    eager_model.forward(ids[:8], eager, logits="none")
    step = DecodeGraph(model, state, graph=True)
    for pos in range(8, 12):
        ref = eager_model.forward(ids[pos:pos + 1], eager, logits="all").logits
        assert rel_err(step.step(ids[pos:pos + 1]), ref) < 1e-4
    hybrid.close()


def test_shared_expert_rides_in_the_routed_launches_of_a_loaded_model(q4_model_file, prompt_and_stats, monkeypatch):
    """Q4_0 projections and every expert hot in Q4_0 slots through the Triton kernels: decode-sized
    calls take the shared expert into the routed launches (``moe_with_shared``), with the same
    logits as computing it apart (``LUCE_TUNE_SHARED_IN_MOE=0``); a prompt longer than the
    decode launches takes it apart."""
    import engine.kernels.quant.triton as tq
    from engine.hybrid import SHARED_IN_MOE_ENV

    ids, stats = prompt_and_stats
    calls = []
    real = tq.quantized_moe_triton
    monkeypatch.setattr(tq, "quantized_moe_triton",
                        lambda *a, **k: calls.append(k.get("shared") is not None) or real(*a, **k))

    def run(tokens):
        with GGUFFile(q4_model_file) as f:
            model = Qwen35MoE.from_gguf(f, dtype=torch.float32, quantized=True)
        hybrid = attach_hybrid(model, quantized_mb(q4_model_file), stats, threads=2, cold_format="quantized",
                               gguf_file=GGUFFile(q4_model_file), cold_dtype=torch.float32, hot_format="quantized",
                               impl="triton")
        out = logits(model, tokens)
        hybrid.close()
        return out

    fused = run(ids[:5])
    assert calls and all(calls)  # every MoE layer, shared expert inside
    calls.clear()
    monkeypatch.setenv(SHARED_IN_MOE_ENV, "0")
    apart = run(ids[:5])
    assert calls and not any(calls)
    assert rel_err(fused, apart) < 1e-5
    monkeypatch.delenv(SHARED_IN_MOE_ENV)
    calls.clear()
    run(torch.cat([ids, ids])[:17])  # 17 tokens: past the decode launches
    assert not any(calls)
