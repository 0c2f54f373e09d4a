"""Hybrid expert executor: same outputs at every budget, counters, in-place re-placement, and
the model wired to it. On the CPU both tiers live in host memory; on CUDA the hot tier is in
device slots and the cold tier runs on CPU threads.

Bounds: float32 tiers must agree with the reference to 1e-5 of the largest output (only the
order of the sum over experts differs); bf16 tiers on CUDA to 2e-2 of the float32 reference
computed from the same rounded weights (the CPU tier rounds the gate/up outputs and the
activation to bf16, as the model's torch executor does: about 7e-3 measured on the CPU).
"""

import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are decorated

from engine.errors import ConfigError  # noqa: E402
from engine.hybrid import HybridExperts, attach_hybrid  # noqa: E402
from engine.kernels.moe import moe_reference  # noqa: E402
from engine.placement import MB, RoutingStats, calibrate_routing, plan_placement  # noqa: E402

L, E, H, F_, K = 3, 12, 40, 24, 3
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def random_experts(n_layers=L, n_expert=E, hidden=H, ffn=F_, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n_expert, ffn, hidden, generator=g) / hidden**0.5).to(dtype),
             (torch.randn(n_expert, ffn, hidden, generator=g) / hidden**0.5).to(dtype),
             (torch.randn(n_expert, hidden, ffn, generator=g) / ffn**0.5).to(dtype)) for _ in range(n_layers)]


def skewed_stats(n_layers=L, n_expert=E, seed=1):
    g = torch.Generator().manual_seed(seed)
    return RoutingStats(torch.rand(n_layers, n_expert, generator=g, dtype=torch.float64) ** 4 * 1000,
                        tokens=1000, calibrated=True)


def routing(T, n_expert=E, k=K, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_expert, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    return ids.to(device), w.to(device)


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def total_mb(experts):
    return sum(t.numel() * t.element_size() for layer in experts for t in layer) / MB


@pytest.fixture
def experts():
    return random_experts()


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("T", [1, 6])
def test_same_outputs_at_every_budget(experts, fraction, T):
    hybrid = HybridExperts(experts, fraction * total_mb(experts), device="cpu", stats=skewed_stats(), min_hot=K,
                           threads=2)
    for layer in range(L):
        x = torch.randn(T, H)
        ids, w = routing(T, seed=layer)
        out = hybrid(layer, x, ids, w)
        assert out.shape == (T, H) and out.dtype == torch.float32
        assert rel_err(out, moe_reference(x, *experts[layer], ids, w)) < 1e-5
    hybrid.close()


def test_triton_hot_tier_matches_reference(experts):
    pytest.importorskip("triton")
    hybrid = HybridExperts(experts, 0.5 * total_mb(experts), device="cpu", stats=skewed_stats(), min_hot=K,
                           threads=2, impl="triton")
    x = torch.randn(5, H)
    ids, w = routing(5, seed=3)
    assert rel_err(hybrid(1, x, ids, w), moe_reference(x, *experts[1], ids, w)) < 1e-5
    hybrid.close()


def test_counters_measure_cold_hits_and_expert_memory(experts):
    stats = skewed_stats()
    hybrid = HybridExperts(experts, 0.5 * total_mb(experts), device="cpu", stats=stats, min_hot=K, threads=2)
    placement = hybrid.placement
    hot = placement.hot_mask()
    cold = pairs = 0
    for step in range(4):
        for layer in range(L):
            ids, w = routing(3, seed=10 * step + layer)
            hybrid(layer, torch.randn(3, H), ids, w)
            cold += int((~hot[layer][ids]).sum())
            pairs += ids.numel()
    snap = hybrid.stats_snapshot()
    assert snap.hot_hits + snap.cold_hits == pairs and snap.cold_hits == cold
    assert snap.cold_hit_rate == pytest.approx(cold / pairs)
    assert snap.hot_experts == placement.hot_count and snap.cold_experts == L * E - placement.hot_count
    assert snap.expert_vram_mb * MB == placement.hot_count * 3 * F_ * H * 4
    assert snap.expected_cold_hit_rate == placement.expected_cold_hit_rate
    assert set(snap.as_dict()) >= {"hot_hits", "cold_hits", "cold_hit_rate", "expert_vram_mb"}
    hybrid.reset_counters()
    assert hybrid.stats_snapshot().hot_hits == 0 and hybrid.stats_snapshot().cold_hits == 0
    hybrid.close()


def test_set_budget_moves_experts_in_place(experts):
    stats = skewed_stats()
    hybrid = HybridExperts(experts, 0, device="cpu", stats=stats, min_hot=K, threads=2)
    x = torch.randn(4, H)
    ids, w = routing(4, seed=9)
    for fraction in (0.5, 0.25, 1.0, 0.0, 0.75):
        budget = fraction * total_mb(experts)
        placement = hybrid.set_budget(budget)
        assert placement.hot == plan_placement(stats, hybrid.expert_bytes, budget, K).hot
        for layer, tiers in enumerate(hybrid._layers):
            assert tiers.hot == placement.hot[layer]
            for slot, e in enumerate(tiers.hot):
                for resident, master in zip(tiers.slots, experts[layer]):
                    assert torch.equal(resident[slot], master[e])
            assert torch.equal(tiers.slot_of >= 0, placement.hot_mask()[layer])
        assert rel_err(hybrid(2, x, ids, w), moe_reference(x, *experts[2], ids, w)) < 1e-5
    hybrid.close()


def test_oversize_budget_is_refused_before_anything_moves(experts):
    hybrid = HybridExperts(experts, 0.25 * total_mb(experts), device="cpu", stats=skewed_stats(), min_hot=K,
                           threads=1, max_expert_mb=0.5 * total_mb(experts))
    before = hybrid.placement
    with pytest.raises(ConfigError, match=r"does not fit on cpu.*largest expert budget that fits is \d+ MB"):
        hybrid.set_budget(total_mb(experts))
    assert hybrid.placement is before and [t.hot for t in hybrid._layers] == list(before.hot)
    with pytest.raises(ConfigError, match="below the"):
        hybrid.set_budget(0.01 * total_mb(experts))
    hybrid.close()


@pytest.fixture(scope="module")
def tiny_model_file(tmp_path_factory):
    from engine.gguf.make_model import make_model

    return make_model(tmp_path_factory.mktemp("hybrid") / "tiny.gguf", "tiny", n_expert=16, router_skew=1.0, seed=4)


def load_model(path, device="cpu", dtype=None):
    from engine.gguf.reader import GGUFFile
    from engine.model.qwen35moe import Qwen35MoE

    with GGUFFile(path) as f:
        return Qwen35MoE.from_gguf(f, device=device, dtype=dtype)


def model_logits(model, ids):
    return model.forward(ids, model.new_state(len(ids)), logits="all").logits


def greedy(model, prompt, n):
    state = model.new_state(len(prompt) + n)
    out = model.forward(prompt, state, logits="last")
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[-1].argmax()))
        out = model.forward(torch.tensor([tokens[-1]], device=prompt.device), state, logits="last")
    return tokens


@pytest.fixture(scope="module")
def plain_run(tiny_model_file):
    """(prompt, logits, greedy continuation) of the model with its default executor."""
    plain = load_model(tiny_model_file)
    ids = torch.randint(0, plain.cfg.vocab, (9,), generator=torch.Generator().manual_seed(0))
    return ids, model_logits(plain, ids), greedy(plain, ids, 6)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_model_with_hybrid_experts_matches_plain_model(tiny_model_file, plain_run, fraction):
    ids, ref_logits, ref_tokens = plain_run
    model = load_model(tiny_model_file)
    stats = calibrate_routing(model, [ids.tolist(), list(range(40, 60))])
    k = model.cfg.n_expert_used
    assert stats.tokens == 29 and torch.equal(stats.counts.sum(1), torch.full((model.cfg.n_layers,), 29.0 * k))
    expert_tensors = [(ew.gate, ew.up, ew.down) for ew in (layer.moe.experts for layer in model.weights.layers)]
    full_mb = sum(t.numel() * t.element_size() for layer in expert_tensors for t in layer) / MB
    hybrid = attach_hybrid(model, fraction * full_mb, stats, threads=2)
    assert model.executor is hybrid
    moved = [(ew.gate, ew.up, ew.down) for ew in (layer.moe.experts for layer in model.weights.layers)]
    assert all(a is b for old, new in zip(expert_tensors, moved) for a, b in zip(old, new))  # no copy on the CPU

    assert rel_err(model_logits(model, ids), ref_logits) < 1e-4
    assert greedy(model, ids, 6) == ref_tokens
    snap = hybrid.stats_snapshot()
    assert snap.hot_hits + snap.cold_hits > 0
    assert (snap.cold_hits == 0) == (fraction == 1.0) and (snap.hot_hits == 0) == (fraction == 0.0)
    hybrid.close()


def test_engine_generates_the_same_with_calibrated_hybrid_experts(tiny_model_file):
    from engine.engine import Engine
    from engine.placement import load_routing_stats

    eng = Engine.from_gguf(tiny_model_file, device="cpu")
    ids = eng.tokenizer.encode("def add(a, b):\n    return a + b\n")
    plain = eng.generate(ids, 8)
    calibrate_routing(eng.model, [ids]).save(tiny_model_file)
    stats = load_routing_stats(tiny_model_file, eng.config)
    assert stats.calibrated
    hybrid = attach_hybrid(eng.model, 0.3, stats, threads=2)
    assert eng.generate(ids, 8).ids == plain.ids
    snap = hybrid.stats_snapshot()
    assert snap.hot_hits > 0 and snap.cold_hits > 0 and 0 < snap.expert_vram_mb <= 0.3
    # the prompt it was calibrated on is routed as the statistics predicted, within a few pairs
    assert snap.cold_hit_rate == pytest.approx(snap.expected_cold_hit_rate, abs=0.1)
    hybrid.close()


def test_engine_places_whole_layers_with_the_layer_unit(tiny_model_file, plain_run, monkeypatch):
    """``placement_unit="layer"``: past each layer's minimum the budget fills whole layers (one at most partly),
    the output is the same, the unit stays set for later budgets and ``unit="expert"`` spreads the hot experts."""
    from engine.engine import Engine

    ids, _, _ = plain_run
    eng = Engine.from_gguf(tiny_model_file, device="cpu")
    plain = eng.generate(ids.tolist(), 6, ignore_eos=True).ids
    L, E, k = eng.config.n_layers, eng.config.n_expert, eng.config.n_expert_used
    size = eng.set_expert_budget(0, unit="layer").expert_bytes[0]
    budget = (k * L + 1.5 * (E - k)) * size / MB
    by_layer = eng.set_expert_budget(budget)
    assert eng.hybrid.unit == "layer"
    assert sorted(len(h) for h in by_layer.hot) == [k] * (L - 2) + [k + (E - k) // 2, E]
    assert eng.generate(ids.tolist(), 6, ignore_eos=True).ids == plain
    by_expert = eng.set_expert_budget(budget, unit="expert")
    assert eng.hybrid.unit == "expert" and by_expert.hot_count == by_layer.hot_count
    assert sorted(len(h) for h in by_expert.hot) != sorted(len(h) for h in by_layer.hot)
    assert eng.generate(ids.tolist(), 6, ignore_eos=True).ids == plain
    eng.hybrid.close()
    with pytest.raises(ConfigError, match="placement_unit must be one of expert, layer"):
        Engine.from_gguf(tiny_model_file, device="cpu", expert_budget_mb=budget, placement_unit="block")
    monkeypatch.setenv("LUCE_TUNE_PLACEMENT_UNIT", "block")
    with pytest.raises(ConfigError, match="LUCE_TUNE_PLACEMENT_UNIT must be one of"):
        Engine.from_gguf(tiny_model_file, device="cpu", expert_budget_mb=budget)
    monkeypatch.setenv("LUCE_TUNE_PLACEMENT_UNIT", "layer")
    eng = Engine.from_gguf(tiny_model_file, device="cpu", expert_budget_mb=budget)
    assert eng.hybrid.unit == "layer" and eng.hybrid.placement.hot == by_layer.hot
    eng.hybrid.close()


@pytest.fixture(scope="module")
def real_experts():
    """Four layers of experts at the real shapes, bf16 in pinned host memory (6 GiB)."""
    return [tuple(t.pin_memory() for t in layer) for layer in random_experts(4, 256, 2048, 512, dtype=torch.bfloat16)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("T", [1, 16, 200])
def test_cuda_tiers_at_real_shapes_bf16(real_experts, fraction, T):
    experts = real_experts[:2]
    hybrid = HybridExperts(experts, fraction * total_mb(experts), device="cuda", stats=skewed_stats(2, 256), min_hot=8)
    assert hybrid.stats_snapshot().expert_vram_mb == pytest.approx(fraction * total_mb(experts), abs=7)
    x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(T, 256, 8, seed=T, device="cuda")
    out = hybrid(1, x, ids, w)
    ref = moe_reference(x.float().cpu(), *(t.float() for t in experts[1]), ids.cpu(), w.cpu())
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16
    assert rel_err(out.cpu(), ref) < 2e-2
    hybrid.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_set_budget_moves_gigabytes_per_second(real_experts):
    hybrid = HybridExperts(real_experts, 0, device="cuda", stats=skewed_stats(4, 256), min_hot=8)
    t0 = time.perf_counter()
    hybrid.set_budget(total_mb(real_experts))
    seconds = time.perf_counter() - t0
    gb_s = total_mb(real_experts) * MB / seconds / 1e9
    print(f"set_budget uploaded {total_mb(real_experts):.0f} MB in {seconds:.2f} s ({gb_s:.1f} GB/s); "
          f"a 35B model's 60 GiB of bf16 experts would take {64.4 / gb_s:.1f} s")
    assert gb_s > 4.0
    t0 = time.perf_counter()
    hybrid.set_budget(0.5 * total_mb(real_experts))
    print(f"set_budget down to half took {time.perf_counter() - t0:.2f} s")
    assert hybrid.expert_vram_bytes <= 0.5 * total_mb(real_experts) * MB
    hybrid.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_cuda_model_with_hybrid_experts_matches_plain_model(tiny_model_file, fraction):
    plain = load_model(tiny_model_file, "cuda", torch.float32)
    ids = torch.randint(0, plain.cfg.vocab, (9,), generator=torch.Generator().manual_seed(0)).cuda()
    ref_logits, ref_tokens = model_logits(plain, ids), greedy(plain, ids, 6)
    del plain
    model = load_model(tiny_model_file, "cuda", torch.float32)
    full_mb = sum(t.numel() * t.element_size() for layer in model.weights.layers
                  for t in (layer.moe.experts.gate, layer.moe.experts.up, layer.moe.experts.down)) / MB
    hybrid = attach_hybrid(model, fraction * full_mb)
    assert all(layer.moe.experts.gate.device.type == "cpu" for layer in model.weights.layers)
    assert rel_err(model_logits(model, ids).cpu(), ref_logits.cpu()) < 1e-4
    assert greedy(model, ids, 6) == ref_tokens
    hybrid.close()
