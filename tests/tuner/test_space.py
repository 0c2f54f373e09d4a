import dataclasses
from pathlib import Path

import optuna
import pytest

from tuner.config import load_config
from engine.hardware import Gpu, Hardware
from tuner.space import NO_DRAFT, SearchSpace, TrialParams

CPU_ONLY = Hardware(gpu=None, cpu="test cpu", cpu_count=2, ram_mb=24000, cgroup_max_mb=None)
H200 = dataclasses.replace(CPU_ONLY, gpu=Gpu(nvml_index=0, name="NVIDIA H200", uuid="GPU-1",
                                               driver="570", total_mb=143771))
DRAFT = Path("/m/luce-draft.gguf")


def _config(tmp_path, extra=""):
    text = """
[models]
target = "t.gguf"
drafts = ["luce-draft.gguf"]
drafter = "drafter.gguf"
[study]
trials = 4
[publish]
profile = "p.toml"
""" + extra
    path = tmp_path / "appliance.toml"
    path.write_text(text)
    return load_config(path)


def _sample(space, n=40, seed=0):
    study = optuna.create_study(directions=["maximize", "minimize"],
                                sampler=optuna.samplers.RandomSampler(seed=seed))
    points = []
    for _ in range(n):
        trial = study.ask()
        p = space.suggest(trial)
        points.append((p, dict(trial.params)))
        study.tell(trial, [1.0, 1.0])
    return points


def _assert_enqueued_as_given(space, points):
    """Enqueued through ``to_params``, each point comes back from ``suggest`` as it was."""
    study = optuna.create_study(directions=["maximize", "minimize"])
    for p in points:
        study.enqueue_trial(space.to_params(p))
    for p in points:
        trial = study.ask()
        assert space.suggest(trial) == p
        study.tell(trial, [1.0, 1.0])


def test_cpu_only_without_draft_or_drafter_has_no_dimension(tmp_path):
    space = SearchSpace.build(_config(tmp_path), CPU_ONLY, drafts=(), drafter_ok=False, experts_mb=100)
    assert space.budget_max_mb is None and space.drafts == () and space.keep_ratio is None
    for p, params in _sample(space, 5):
        assert p == TrialParams() and params == {}
    assert space.warm_start() == [TrialParams()]


def test_gpu_budget_bounds_from_live_memory_cap_reserve_and_model_size(tmp_path):
    cfg = _config(tmp_path, "[hardware]\nvram_cap_mb = 10000\nvram_reserve_mb = 1000\n"
                            "[search]\nexpert_budget_step_mb = 512\n")
    big = SearchSpace.build(cfg, H200, drafts=(), drafter_ok=False, experts_mb=20000)
    assert big.budget_max_mb == 8704  # (10000 - 1000) rounded down to the 512 MB step
    assert big.full_model_mb is None  # the whole model does not fit
    small = SearchSpace.build(cfg, H200, drafts=(), drafter_ok=False, experts_mb=3000)
    assert small.budget_max_mb == small.full_model_mb == 3072  # nothing gained past the experts' size
    live = SearchSpace.build(_config(tmp_path), H200, drafts=(), drafter_ok=False, experts_mb=10**6)
    assert live.budget_max_mb == (143771 - 1024) // 256 * 256
    for p, params in _sample(big):
        assert 0 <= p.expert_budget_mb <= 8704 and p.expert_budget_mb % 512 == 0
        assert set(params) == {"expert_budget_mb"}


def test_draft_and_spec_len_are_conditional(tmp_path):
    space = SearchSpace.build(_config(tmp_path), CPU_ONLY, drafts=(DRAFT,), drafter_ok=False,
                              experts_mb=100)
    seen = set()
    for p, params in _sample(space, 60):
        if params["draft"] == NO_DRAFT:
            assert p.draft is None and p.spec_len is None and "spec_len" not in params
        else:
            assert p.draft == "luce-draft.gguf" and 2 <= p.spec_len <= 8
            assert params["spec_len"] == p.spec_len
        seen.add(params["draft"])
        assert space.params_of(params) == p
        assert space.to_params(p) == params
    assert seen == {NO_DRAFT, "luce-draft.gguf"}


def test_pflash_needs_a_compatible_drafter_and_long_prompts(tmp_path):
    cfg = _config(tmp_path)
    assert SearchSpace.build(cfg, CPU_ONLY, drafts=(), drafter_ok=False, experts_mb=1).keep_ratio is None
    no_long = _config(tmp_path, "[workload]\nlong_form_prompts = 0\nniah_cases = 0\n"
                                "[constraints]\nniah_min_accuracy = 0.0\n")
    assert SearchSpace.build(no_long, CPU_ONLY, drafts=(), drafter_ok=True, experts_mb=1).keep_ratio is None
    space = SearchSpace.build(cfg, CPU_ONLY, drafts=(), drafter_ok=True, experts_mb=1)
    assert space.keep_ratio == (0.05, 0.5)
    states = set()
    for p, params in _sample(space, 60):
        if params["pflash"] == "off":
            assert p.pflash_keep_ratio is None and "pflash_keep_ratio" not in params
        else:
            assert 0.05 <= p.pflash_keep_ratio <= 0.5
        states.add(params["pflash"])
        assert space.params_of(params) == p
    assert states == {"on", "off"}


def test_warm_start_points_are_enqueued_as_given(tmp_path):
    space = SearchSpace.build(_config(tmp_path), H200, drafts=(DRAFT,), drafter_ok=True, experts_mb=2000)
    points = space.warm_start()
    assert points[0] == TrialParams(expert_budget_mb=2048)  # every expert on the GPU, plain decoding
    assert points[1] == TrialParams(expert_budget_mb=2048, draft="luce-draft.gguf", spec_len=5)
    assert points[2].pflash_keep_ratio == pytest.approx((0.05 * 0.5) ** 0.5)
    assert points[3] == TrialParams(expert_budget_mb=1024)
    _assert_enqueued_as_given(space, points)


def test_trial_params_refuse_inconsistent_points():
    with pytest.raises(ValueError, match="spec_len 4 is set without a draft"):
        TrialParams(spec_len=4)
    with pytest.raises(ValueError, match="has no spec_len"):
        TrialParams(draft="d.gguf")


def test_coarse_grid_covers_every_combination_the_space_allows(tmp_path):
    cfg = _config(tmp_path, "[hardware]\nvram_cap_mb = 10000\nvram_reserve_mb = 1000\n"
                            "[search]\nexpert_budget_step_mb = 512\n")
    space = SearchSpace.build(cfg, H200, drafts=(DRAFT,), drafter_ok=True, experts_mb=20000)
    grid = space.coarse_grid(budget_points=4)
    budgets = sorted({p.expert_budget_mb for p in grid})
    assert budgets[0] == 0 and budgets[-1] == space.budget_max_mb and len(budgets) == 4
    assert all(b % 512 == 0 for b in budgets)
    lo, hi = space.spec_len
    assert {p.spec_len for p in grid if p.draft} == {lo, (lo + hi) // 2, hi}
    assert all(p.spec_len is None for p in grid if p.draft is None)
    keeps = {p.pflash_keep_ratio for p in grid}
    assert None in keeps and len(keeps) == 4
    assert len(grid) == len(set(grid)) == 4 * (1 + 3) * 4
    for p in grid:  # every point round-trips through Optuna's parameters
        assert space.params_of(space.to_params(p)) == p
    cpu = SearchSpace.build(_config(tmp_path), CPU_ONLY, drafts=(), drafter_ok=False, experts_mb=100)
    assert cpu.coarse_grid() == [TrialParams()]


def test_the_budget_bound_is_the_experts_size_as_the_engine_holds_them(tmp_path):
    from engine.gguf.make_model import make_model
    from tuner.models import experts_mb

    q4 = make_model(tmp_path / "q4.gguf", "tiny", expert_quant="q4_0", n_expert=64)
    blocks = experts_mb(q4, experts="quantized", dtype=None, gpu=True)
    f32 = experts_mb(q4, experts="dense", dtype="float32", gpu=True)
    assert experts_mb(q4, experts="dense", dtype=None, gpu=False) == f32  # the CPU's default dtype
    bf16 = experts_mb(q4, experts="dense", dtype=None, gpu=True)  # the GPU's
    assert bf16 == experts_mb(q4, experts="dense", dtype="bfloat16", gpu=True)
    assert abs(f32 - 2 * bf16) <= 1
    assert f32 >= 5 * blocks and blocks <= q4.stat().st_size / 2**20 < bf16  # dequantized experts outgrow the file


def test_cold_cpu_share_is_searched_only_where_experts_are_cold_on_the_bus(tmp_path):
    """The CPU share of the cold experts is a dimension only with a GPU, ``cold_device = "gpu"`` and quantized
    experts, and in a point only where its budget leaves experts cold; warm start tries the bus alone and the
    middle share at half the budget; the coarse grid three shares below the full budget; every point
    round-trips through Optuna's parameters; a space without it describes itself as before."""
    gpu = "[engine]\ncold_device = \"gpu\"\nexperts = \"quantized\"\n"
    space = SearchSpace.build(_config(tmp_path, gpu), H200, drafts=(), drafter_ok=False, experts_mb=2000)
    assert space.cpu_share == (0.0, 0.8) and space.full_model_mb == 2048
    seen = []
    for p, params in _sample(space, 60):
        if p.expert_budget_mb < 2048:
            assert 0.0 <= p.cold_cpu_share <= 0.8 and params["cold_cpu_share"] == p.cold_cpu_share
            seen.append(p.cold_cpu_share)
        else:
            assert p.cold_cpu_share is None and "cold_cpu_share" not in params
        assert space.params_of(params) == p
    assert len(seen) > 10 and max(seen) - min(seen) > 0.3
    points = space.warm_start()
    assert points == [TrialParams(expert_budget_mb=2048), TrialParams(expert_budget_mb=1024, cold_cpu_share=0.0),
                      TrialParams(expert_budget_mb=1024, cold_cpu_share=0.4)]
    _assert_enqueued_as_given(space, points)
    grid = space.coarse_grid(budget_points=3)
    assert {(p.expert_budget_mb, p.cold_cpu_share) for p in grid} == {
        (0, 0.0), (0, 0.4), (0, 0.8), (1024, 0.0), (1024, 0.4), (1024, 0.8), (2048, None)}
    for p in grid:
        assert space.params_of(space.to_params(p)) == p
    assert "cpu_share" in space.describe() and space.describe()["cpu_share"] == [0.0, 0.8]
    for extra, hardware in (("", H200), (gpu, CPU_ONLY), ("[engine]\ncold_device = \"gpu\"\n", H200),
                            (gpu + "[search]\ncold_cpu_share = [0.0, 0.0]\n", H200)):
        off = SearchSpace.build(_config(tmp_path, extra), hardware, drafts=(), drafter_ok=False, experts_mb=2000)
        assert off.cpu_share is None and "cpu_share" not in off.describe()
        assert all(p.cold_cpu_share is None for p, _ in _sample(off, 5))
    fixed = SearchSpace.build(_config(tmp_path, gpu + "[search]\ncold_cpu_share = [0.5, 0.5]\n"), H200, drafts=(),
                              drafter_ok=False, experts_mb=2000)
    for p, params in _sample(fixed, 10):
        assert "cold_cpu_share" not in params
        assert p.cold_cpu_share == (0.5 if p.expert_budget_mb < 2048 else None)
        assert fixed.params_of(params) == p
    with pytest.raises(ValueError, match="cold_cpu_share 1.5 is outside"):
        TrialParams(cold_cpu_share=1.5)


def test_placement_unit_is_searched_only_at_budgets_that_leave_some_experts_cold(tmp_path):
    """With two units configured and a GPU, the unit is a categorical dimension at budgets between 0 and the full
    model's (where it changes nothing it is left out); warm start tries the half budget by each unit; the coarse
    grid crosses the units with the CPU shares; points round-trip through Optuna's parameters; one unit (the
    default) or no GPU leaves the space as before."""
    both = "[engine]\ncold_device = \"gpu\"\nexperts = \"quantized\"\n[search]\nplacement_unit = [\"expert\", \"layer\"]\n"
    space = SearchSpace.build(_config(tmp_path, both), H200, drafts=(), drafter_ok=False, experts_mb=2000)
    assert space.units == ("expert", "layer") and space.describe()["placement_units"] == ["expert", "layer"]
    seen = set()
    for p, params in _sample(space, 60):
        if 0 < p.expert_budget_mb < 2048:
            assert p.placement_unit in ("expert", "layer") and params["placement_unit"] == p.placement_unit
            seen.add(p.placement_unit)
        else:
            assert p.placement_unit is None and "placement_unit" not in params
        assert space.params_of(params) == p
    assert seen == {"expert", "layer"}
    points = space.warm_start()
    assert points == [TrialParams(expert_budget_mb=2048),
                      TrialParams(expert_budget_mb=1024, cold_cpu_share=0.0, placement_unit="expert"),
                      TrialParams(expert_budget_mb=1024, cold_cpu_share=0.4, placement_unit="expert"),
                      TrialParams(expert_budget_mb=1024, cold_cpu_share=0.4, placement_unit="layer")]
    _assert_enqueued_as_given(space, points)
    grid = space.coarse_grid(budget_points=3)
    assert {(p.expert_budget_mb, p.placement_unit, p.cold_cpu_share) for p in grid} == {
        (0, None, 0.0), (0, None, 0.4), (0, None, 0.8), (2048, None, None),
        *((1024, u, s) for u in ("expert", "layer") for s in (0.0, 0.4, 0.8))}
    for p in grid:
        assert space.params_of(space.to_params(p)) == p
    assert "by layer" in TrialParams(expert_budget_mb=1024, placement_unit="layer").label()
    for extra, hardware in (("", H200), (both, CPU_ONLY),
                            ("[search]\nplacement_unit = [\"layer\"]\n", H200)):
        off = SearchSpace.build(_config(tmp_path, extra), hardware, drafts=(), drafter_ok=False, experts_mb=2000)
        assert off.units is None and "placement_units" not in off.describe()
        assert all(p.placement_unit is None for p, _ in _sample(off, 5))


def test_the_tuner_knows_the_engine_placement_units():
    from engine.placement import PLACEMENT_UNITS
    from tuner.config import PLACEMENT_UNITS as CONFIG_UNITS

    assert CONFIG_UNITS == PLACEMENT_UNITS


def test_cold_experts_ahead_are_searched_beside_the_cpu_share(tmp_path):
    """``cold_prefetch`` and ``cold_warm`` ranges are integer dimensions wherever the CPU share is one (a GPU,
    cold experts on the bus, a budget that leaves some cold); warm start adds the half budget with both at
    the top of their ranges; the coarse grid takes each end; points round-trip; [0, 0] (the default), no
    CPU-share dimension or no GPU leave them out; bad ranges are refused."""
    gpu = "[engine]\ncold_device = \"gpu\"\nexperts = \"quantized\"\n"
    ahead = gpu + "[search]\ncold_prefetch = [0, 2]\ncold_warm = [1, 2]\n"
    space = SearchSpace.build(_config(tmp_path, ahead), H200, drafts=(), drafter_ok=False, experts_mb=2000)
    assert space.prefetch == (0, 2) and space.warm == (1, 2)
    assert space.describe()["cold_prefetch"] == [0, 2] and space.describe()["cold_warm"] == [1, 2]
    seen = set()
    for p, params in _sample(space, 60):
        if p.expert_budget_mb < 2048:
            assert 0 <= p.cold_prefetch <= 2 and 1 <= p.cold_warm <= 2
            assert (params["cold_prefetch"], params["cold_warm"]) == (p.cold_prefetch, p.cold_warm)
            seen.add((p.cold_prefetch, p.cold_warm))
        else:
            assert p.cold_prefetch is None and p.cold_warm is None and "cold_prefetch" not in params
        assert space.params_of(params) == p
    assert len(seen) == 6
    points = space.warm_start()
    assert points == [TrialParams(expert_budget_mb=2048),
                      TrialParams(expert_budget_mb=1024, cold_cpu_share=0.0, cold_prefetch=0, cold_warm=1),
                      TrialParams(expert_budget_mb=1024, cold_cpu_share=0.4, cold_prefetch=0, cold_warm=1),
                      TrialParams(expert_budget_mb=1024, cold_cpu_share=0.4, cold_prefetch=2, cold_warm=2)]
    _assert_enqueued_as_given(space, points)
    grid = space.coarse_grid(budget_points=3)
    assert {(p.expert_budget_mb, p.cold_prefetch, p.cold_warm) for p in grid} == {
        (2048, None, None), *((b, f, w) for b in (0, 1024) for f in (0, 2) for w in (1, 2))}
    assert len(grid) == 1 + 2 * 3 * 4  # the full budget, then two budgets x three shares x four ends
    for p in grid:
        assert space.params_of(space.to_params(p)) == p
    assert "ahead 2 fetched, 1 warmed" in TrialParams(expert_budget_mb=1024, cold_prefetch=2, cold_warm=1).label()
    for extra, hardware in ((gpu, H200), (ahead, CPU_ONLY),
                            (ahead.replace("[search]\n", "[search]\ncold_cpu_share = [0.0, 0.0]\n"), H200)):
        off = SearchSpace.build(_config(tmp_path, extra), hardware, drafts=(), drafter_ok=False, experts_mb=2000)
        assert off.prefetch is None and off.warm is None and "cold_prefetch" not in off.describe()
        assert all(p.cold_prefetch is None and p.cold_warm is None for p, _ in _sample(off, 5))
    from tuner.config import ConfigError

    for bad in ("[2, 1]", "[0, 9]", "[-1, 1]"):
        with pytest.raises(ConfigError, match="search.cold_warm: expected"):
            _config(tmp_path, f"[search]\ncold_warm = {bad}\n")


def test_the_tuner_knows_the_engine_prefetch_bounds():
    from engine.hybrid import PREFETCH_MAX, WARM_MAX
    from tuner.config import PREFETCH_MAX as CONFIG_MAX, WARM_MAX as CONFIG_WARM_MAX

    assert (CONFIG_MAX, CONFIG_WARM_MAX) == (PREFETCH_MAX, WARM_MAX)


def test_spec_lookup_is_chosen_only_with_a_draft(tmp_path):
    """With several match lengths configured, the committed-text lookup is a categorical dimension of the
    points that take a draft (beside spec_len) and absent from plain decoding's; warm start tries the draft
    with the first and the longest length; the coarse grid crosses the lengths with spec_len; points
    round-trip through Optuna's parameters; a trial stored without the key reads as the first length."""
    space = SearchSpace.build(_config(tmp_path, "[search]\nspec_lookup = [0, 2, 3]\n"), CPU_ONLY, drafts=(DRAFT,),
                              drafter_ok=False, experts_mb=100)
    assert space.spec_lookup == (0, 2, 3) and space.describe()["spec_lookup"] == [0, 2, 3]
    seen = set()
    for p, params in _sample(space, 60):
        if p.draft is None:
            assert p.spec_lookup is None and "spec_lookup" not in params
        else:
            assert p.spec_lookup in (0, 2, 3) and params["spec_lookup"] == p.spec_lookup
            seen.add(p.spec_lookup)
        assert space.params_of(params) == p
        assert space.to_params(p) == params
    assert seen == {0, 2, 3}
    points = space.warm_start()
    assert points == [TrialParams(),
                      TrialParams(draft="luce-draft.gguf", spec_len=5, spec_lookup=0),
                      TrialParams(draft="luce-draft.gguf", spec_len=5, spec_lookup=3)]
    _assert_enqueued_as_given(space, points)
    grid = space.coarse_grid()
    assert {(p.spec_len, p.spec_lookup) for p in grid if p.draft} == {(n, k) for n in (2, 5, 8) for k in (0, 2, 3)}
    assert all(p.spec_lookup is None for p in grid if p.draft is None)
    assert len(grid) == len(set(grid)) == 1 + 3 * 3
    for p in grid:
        assert space.params_of(space.to_params(p)) == p
    assert space.params_of({"draft": "luce-draft.gguf", "spec_len": 4}).spec_lookup == 0
    assert "lookup 3" in TrialParams(draft="d.gguf", spec_len=4, spec_lookup=3).label()
    assert "lookup" not in TrialParams(draft="d.gguf", spec_len=4, spec_lookup=0).label()


def test_spec_lookup_off_or_fixed_is_no_dimension(tmp_path):
    """[0] (the default) or no draft leaves the lookup out (the space describes itself as before); one other
    length is applied to every draft point without being an Optuna parameter."""
    for extra, drafts in (("", (DRAFT,)), ("[search]\nspec_lookup = [0]\n", (DRAFT,)),
                          ("[search]\nspec_lookup = [0, 3]\n", ())):
        off = SearchSpace.build(_config(tmp_path, extra), CPU_ONLY, drafts=drafts, drafter_ok=False, experts_mb=100)
        assert off.spec_lookup is None and "spec_lookup" not in off.describe()
        assert all(p.spec_lookup is None and "spec_lookup" not in params for p, params in _sample(off, 10))
    fixed = SearchSpace.build(_config(tmp_path, "[search]\nspec_lookup = [3]\n"), CPU_ONLY, drafts=(DRAFT,),
                              drafter_ok=False, experts_mb=100)
    for p, params in _sample(fixed, 20):
        assert "spec_lookup" not in params
        assert p.spec_lookup == (3 if p.draft else None)
        assert fixed.params_of(params) == p
    assert fixed.warm_start()[1:] == [TrialParams(draft="luce-draft.gguf", spec_len=5, spec_lookup=3)]


def test_trial_params_refuse_a_bad_spec_lookup():
    with pytest.raises(ValueError, match="spec_lookup 3 is set without a draft"):
        TrialParams(spec_lookup=3)
    with pytest.raises(ValueError, match=r"spec_lookup 17 is outside 0 \(off\) .. 16"):
        TrialParams(draft="d.gguf", spec_len=4, spec_lookup=17)


def test_the_tuner_knows_the_engine_lookup_bound():
    from engine.dflash.lookup import MAX_MIN_MATCH
    from engine.profile import SPEC_LOOKUP_MAX as PROFILE_MAX
    from tuner.config import SPEC_LOOKUP_MAX as CONFIG_MAX

    assert CONFIG_MAX == PROFILE_MAX == MAX_MIN_MATCH
