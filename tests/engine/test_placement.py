"""Routing statistics, the hot-set knapsack and the VRAM-fit check."""

import json
import warnings

import pytest
import torch

from engine.errors import ConfigError, EngineError
from engine.model.config import ModelConfig
from engine.placement import (MB, GpuReserve, ModelFingerprint, Placement, RoutingCounter, RoutingStats,
                              RoutingStatsError, StaleRoutingStats, check_fits, load_routing_stats,
                              min_nonzero_budget_mb, plan_placement, routing_stats_path, state_bytes)

L, E, K = 6, 32, 4


def zipf_router(seed: int, alpha: float = 1.3) -> torch.Tensor:
    """[L, E] routing probabilities: Zipf in a random expert order per layer."""
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** alpha
    return torch.stack([base[torch.randperm(E, generator=g)] for _ in range(L)]) / base.sum()


def sample_routing(probs: torch.Tensor, tokens: int, seed: int) -> list[torch.Tensor]:
    """Per layer, top-k ids [tokens, K] drawn without replacement from ``probs``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.multinomial(probs[layer].expand(tokens, E), K, generator=g) for layer in range(L)]


def measured_cold_rate(placement: Placement, routing: list[torch.Tensor]) -> float:
    hot = placement.hot_mask()
    cold = sum(int((~hot[layer][ids]).sum()) for layer, ids in enumerate(routing))
    return cold / sum(ids.numel() for ids in routing)


def counted(routing: list[torch.Tensor]) -> RoutingStats:
    counter = RoutingCounter(L, E, "cpu")
    for layer, ids in enumerate(routing):
        counter(layer, ids)
    return counter.stats()


EXPERT_BYTES = [3 * 1024 * 4096] * L  # 12 MB per expert; 384 MB per layer
SKEWED = counted(sample_routing(zipf_router(1), 400, seed=2))


@pytest.mark.parametrize("stats", [SKEWED, RoutingStats.uniform(L, E)], ids=["skewed", "uniform"])
@pytest.mark.parametrize("expert_bytes", [EXPERT_BYTES, [b * (1 + i % 3) for i, b in enumerate(EXPERT_BYTES)]],
                         ids=["equal", "mixed"])
@pytest.mark.parametrize("unit", ["expert", "layer", "alternate"])
def test_knapsack_respects_budget_minimum_and_nesting(stats, expert_bytes, unit):
    total_mb = E * sum(expert_bytes) / MB
    floor_mb = min_nonzero_budget_mb(expert_bytes, K)
    previous: list[set[int]] | None = None
    for budget in [floor_mb + (total_mb - floor_mb) * f for f in (0.0, 0.1, 0.3, 0.31, 0.5, 0.9, 0.999)]:
        p = plan_placement(stats, expert_bytes, budget, K, unit=unit)
        assert p.hot_bytes <= budget * MB
        assert all(len(h) >= K for h in p.hot)
        assert p.hot_count + p.cold_count == L * E
        assert p.hot_bytes + p.cold_bytes == E * sum(expert_bytes)
        # the next expert in line would not have fitted: the budget is used up to one expert
        assert budget * MB - p.hot_bytes < max(expert_bytes) or p.cold_count == 0
        sets = [set(h) for h in p.hot]
        if previous is not None:
            assert all(old <= new for old, new in zip(previous, sets))
        previous = sets


@pytest.mark.parametrize("stats", [SKEWED, RoutingStats.uniform(L, E)], ids=["skewed", "uniform"])
def test_layer_unit_leaves_cold_experts_in_as_few_layers_as_fit(stats):
    """``unit="layer"``: past each layer's minimum, whole layers go hot one at a time, so at most one layer is
    partly hot and the others hold all their experts or only the minimum; with uniform routing the last layers
    go first (llama.cpp's ``-ncmoe`` keeps the first layers' experts off the GPU)."""
    floor_mb = min_nonzero_budget_mb(EXPERT_BYTES, K)
    budget = floor_mb + 2.5 * (E - K) * EXPERT_BYTES[0] / MB  # room for two and a half layers past the minimum
    p = plan_placement(stats, EXPERT_BYTES, budget, K, unit="layer")
    sizes = [len(h) for h in p.hot]
    assert sorted(sizes) == [K] * (L - 3) + [K + (E - K) // 2, E, E]
    if not stats.calibrated:
        assert sizes[-2:] == [E, E] and sizes[-3] == K + (E - K) // 2
    mixed = plan_placement(stats, EXPERT_BYTES, budget, K, unit="expert")
    assert sum(K < n < E for n in (len(h) for h in mixed.hot)) > 1  # experts spread over the layers
    if stats.calibrated:  # skewed routing: spreading the hot experts catches more of it
        assert mixed.expected_cold_hit_rate < p.expected_cold_hit_rate
    with pytest.raises(ConfigError, match="placement unit"):
        plan_placement(stats, EXPERT_BYTES, budget, K, unit="block")


@pytest.mark.parametrize("stats", [SKEWED, RoutingStats.uniform(L, E)], ids=["skewed", "uniform"])
def test_alternate_unit_puts_a_hot_layer_before_each_cold_one(stats):
    """``unit="alternate"``: whole layers as with ``"layer"``, but every other layer from the last goes first, so
    that up to half the layers hot no two layers with cold experts are neighbours; past half, the rest follow
    in ``"layer"``'s order."""
    floor_mb = min_nonzero_budget_mb(EXPERT_BYTES, K)
    layer_mb = (E - K) * EXPERT_BYTES[0] / MB
    p = plan_placement(stats, EXPERT_BYTES, floor_mb + 2.5 * layer_mb, K, unit="alternate")
    sizes = [len(h) for h in p.hot]  # L = 6: layers 5, 3 and 1 go first
    assert sorted(sizes) == [K] * 3 + [K + (E - K) // 2, E, E]
    assert {i for i, n in enumerate(sizes) if n > K} <= {1, 3, 5}
    if not stats.calibrated:
        assert sizes == [K, K + (E - K) // 2, K, E, K, E]
    more = plan_placement(stats, EXPERT_BYTES, floor_mb + 3.5 * layer_mb, K, unit="alternate")
    more_sizes = [len(h) for h in more.hot]
    assert [more_sizes[i] for i in (1, 3, 5)] == [E, E, E] and sorted(more_sizes[i] for i in (0, 2, 4)) == [
        K, K, K + (E - K) // 2]
    assert all(set(a) <= set(b) for a, b in zip(p.hot, more.hot))


def test_budget_extremes():
    none = plan_placement(SKEWED, EXPERT_BYTES, 0, K)
    assert none.hot_count == 0 and none.hot_bytes == 0 and none.expected_cold_hit_rate == pytest.approx(1.0)
    total_mb = E * sum(EXPERT_BYTES) / MB
    for budget in (total_mb, 10 * total_mb):
        every = plan_placement(SKEWED, EXPERT_BYTES, budget, K)
        assert every.cold_count == 0 and every.expected_cold_hit_rate == pytest.approx(0.0)


def test_budget_below_minimum_is_refused_with_the_minimum():
    floor_mb = min_nonzero_budget_mb(EXPERT_BYTES, K)
    assert floor_mb == pytest.approx(L * K * 12)
    with pytest.raises(ConfigError, match=r"below the 288\.0 MB .* use 0"):
        plan_placement(SKEWED, EXPERT_BYTES, floor_mb - 1, K)
    with pytest.raises(ConfigError, match="finite"):
        plan_placement(SKEWED, EXPERT_BYTES, -5, K)


def test_min_hot_are_the_most_routed_of_each_layer():
    p = plan_placement(SKEWED, EXPERT_BYTES, min_nonzero_budget_mb(EXPERT_BYTES, K), K)
    for layer, hot in enumerate(p.hot):
        top = torch.topk(SKEWED.counts[layer], K).indices.tolist()
        assert set(hot) == set(top)


def test_calibrated_placement_beats_uniform_on_held_out_routing():
    probs = zipf_router(5)
    stats = counted(sample_routing(probs, 300, seed=6))
    held_out = sample_routing(probs, 300, seed=7)
    budget = 0.25 * E * sum(EXPERT_BYTES) / MB
    calibrated = plan_placement(stats, EXPERT_BYTES, budget, K)
    uniform = plan_placement(RoutingStats.uniform(L, E), EXPERT_BYTES, budget, K)
    assert calibrated.hot_count == uniform.hot_count
    cal_rate, uni_rate = measured_cold_rate(calibrated, held_out), measured_cold_rate(uniform, held_out)
    assert uniform.expected_cold_hit_rate == pytest.approx(0.75)
    assert cal_rate < 0.6 * uni_rate
    # the prediction from the calibration set holds on held-out routing within sampling noise
    assert cal_rate == pytest.approx(calibrated.expected_cold_hit_rate, abs=0.03)


def test_routing_counter_counts_every_pair():
    routing = sample_routing(zipf_router(3), 50, seed=4)
    stats = counted(routing)
    assert stats.tokens == 50 and stats.calibrated
    assert torch.equal(stats.counts.sum(1), torch.full((L,), 50.0 * K, dtype=torch.float64))
    assert torch.equal(stats.counts[2], torch.bincount(routing[2].flatten(), minlength=E).double())


CFG = ModelConfig(n_layers=L, hidden=64, vocab=100, n_head=4, n_head_kv=2, head_dim=16, rms_eps=1e-6,
                  rope_theta=1e4, rope_dim=8, n_expert=E, n_expert_used=K, expert_ffn=16, shared_ffn=16,
                  conv_kernel=4, gdn_k_heads=2, gdn_v_heads=4, gdn_head_k=16, gdn_head_v=16,
                  full_attention_interval=3)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(range(256)) * 64)
    return path


def test_stats_round_trip_beside_the_model(model_file):
    path = SKEWED.save(model_file)
    assert path == routing_stats_path(model_file) == model_file.with_name("m.routing.json")
    loaded = load_routing_stats(model_file, CFG)
    assert loaded.calibrated and loaded.tokens == SKEWED.tokens
    assert torch.equal(loaded.counts, SKEWED.counts)


def test_absent_stats_are_uniform(model_file):
    stats = load_routing_stats(model_file, CFG)
    assert not stats.calibrated and stats.counts.shape == (L, E)
    assert torch.allclose(stats.probabilities(), torch.full((L, E), 1 / E, dtype=torch.float64))


@pytest.mark.parametrize("change", ["size", "content"])
def test_stale_stats_are_ignored_with_a_warning(model_file, change):
    SKEWED.save(model_file)
    data = bytearray(model_file.read_bytes())
    if change == "size":
        data += b"\0"
    else:
        data[100] ^= 0xFF
    model_file.write_bytes(bytes(data))
    assert ModelFingerprint.of(model_file).size == len(data)
    with pytest.warns(StaleRoutingStats, match="another model file"):
        stats = load_routing_stats(model_file, CFG)
    assert not stats.calibrated


def test_fresh_stats_load_without_warning(model_file):
    SKEWED.save(model_file)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_routing_stats(model_file, CFG).calibrated


def test_corrupt_or_mismatched_stats_are_errors(model_file):
    path = routing_stats_path(model_file)
    path.write_text("{not json")
    with pytest.raises(RoutingStatsError, match="m.routing.json"):
        load_routing_stats(model_file, CFG)
    RoutingStats.uniform(L + 1, E).save(model_file)
    with pytest.raises(RoutingStatsError, match=r"shape \(7, 32\), expected \(6, 32\)"):
        load_routing_stats(model_file, CFG)
    doc = json.loads(path.read_text())
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(RoutingStatsError, match="version 99"):
        load_routing_stats(model_file, CFG)


def test_oversize_budget_is_refused_with_the_largest_that_fits():
    reserve = GpuReserve(state_mb=640, margin_mb=1024)
    p = plan_placement(SKEWED, EXPERT_BYTES, 1200, K)
    check_fits(p, 1200.0, torch.device("cuda:0"), reserve)
    with pytest.raises(EngineError) as err:
        check_fits(p, 700.4, torch.device("cuda:0"), reserve)
    msg = str(err.value)
    assert "expert budget 1200 MB" in msg and "does not fit on cuda:0" in msg
    assert "640 MB of KV cache" in msg and "1024 MB safety margin" in msg
    assert msg.endswith("the largest expert budget that fits is 700 MB")
    check_fits(p, None, torch.device("cpu"), reserve)  # host memory: no device limit


def test_state_bytes_of_the_real_model():
    real = ModelConfig(n_layers=40, hidden=2048, vocab=248320, n_head=16, n_head_kv=2, head_dim=256, rms_eps=1e-6,
                       rope_theta=1e7, rope_dim=64, n_expert=256, n_expert_used=8, expert_ffn=512, shared_ffn=512,
                       conv_kernel=4, gdn_k_heads=16, gdn_v_heads=32, gdn_head_k=128, gdn_head_v=128,
                       full_attention_interval=4)
    kv_per_token = 10 * 2 * 2 * 256 * 2  # 10 attention layers, K and V, 2 kv heads, head 256, bf16
    gdn = 30 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
    assert state_bytes(real, 32768, torch.bfloat16) == 32768 * kv_per_token + gdn


def test_stats_validation():
    with pytest.raises(ValueError, match="non-negative"):
        RoutingStats(torch.tensor([[1.0, -1.0]]), tokens=1, calibrated=True)
    with pytest.raises(ValueError, match="shape"):
        RoutingStats(torch.ones(3), tokens=1, calibrated=True)
