import time

import pytest

from tuner.protocol import Job, Load, Loaded, LoadSpec, Measure, Measured
from tuner.worker import EngineWorker, WorkerError

from .conftest import FAKE

JOBS = (Job("code/a", "def add(a, b):", 4), Job("long/0", "text " * 40, 4, long=True))


@pytest.fixture
def target(appliance, tmp_path):
    def make(behaviour=None):
        appliance(behaviour=behaviour)
        return str(tmp_path / "models" / "target.gguf")
    return make


def test_measure_reuses_the_engine_and_reloads_only_for_a_new_draft(target, tmp_path):
    spec = LoadSpec(target=target())
    with EngineWorker(FAKE) as w:
        assert w.cold
        loaded = w.request(Load(spec), timeout_s=30, load_timeout_s=60)
        assert isinstance(loaded, Loaded) and loaded.device == "cpu"
        assert w.cold  # loaded, but no measurement has warmed it yet
        pid = w.pid
        m = w.request(Measure(spec=spec, jobs=JOBS, warmup=1, repeats=2), timeout_s=30, load_timeout_s=60)
        assert isinstance(m, Measured) and not w.cold
        assert [(o.key, o.repeat) for o in m.outputs] == [("code/a", 0), ("long/0", 0), ("code/a", 1), ("long/0", 1)]
        assert m.outputs[0].ids == m.outputs[2].ids and len(m.outputs[0].ids) == 4
        assert m.outputs[0].timings["new_tokens"] == 4
        with_draft = LoadSpec(target=spec.target, draft=str(tmp_path / "models" / "draft.gguf"))
        m2 = w.request(Measure(spec=with_draft, jobs=JOBS, spec_len=3, repeats=1),
                       timeout_s=30, load_timeout_s=60)
        assert m2.outputs[0].timings["acceptance_length"] == 2.5
        assert m2.outputs[0].timings["lookup"] == 0  # not asked for: the engine's default, off
        m3 = w.request(Measure(spec=with_draft, jobs=JOBS, spec_len=3, spec_lookup=2, repeats=1),
                       timeout_s=30, load_timeout_s=60)
        assert m3.outputs[0].timings["lookup"] == 2  # passed through to generate()
        assert w.pid == pid  # one long-lived process


def test_engine_errors_come_back_and_the_worker_lives_on(target, tmp_path):
    path = target({"incompatible": ["draft.gguf"]})
    spec = LoadSpec(target=path, draft=str(tmp_path / "models" / "draft.gguf"))
    with EngineWorker(FAKE) as w:
        with pytest.raises(WorkerError, match="draft hidden size 5120") as info:
            w.request(Load(spec), timeout_s=30, load_timeout_s=60)
        assert info.value.kind == "user"
        pid = w.pid
        w.request(Load(LoadSpec(target=path)), timeout_s=30, load_timeout_s=60)
        assert w.pid == pid


def test_a_hung_request_is_killed_and_the_next_one_gets_a_fresh_worker(target):
    spec = LoadSpec(target=target())
    with EngineWorker(FAKE) as w:
        w.request(Load(spec), timeout_s=30, load_timeout_s=60)
        first = w.pid
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="no answer within 2 s") as info:
            w.request(Measure(spec=spec, jobs=JOBS, hang_s=600), timeout_s=2, load_timeout_s=60)
        assert info.value.kind == "timeout" and time.monotonic() - t0 < 10
        assert not w.alive and w.cold
        m = w.request(Measure(spec=spec, jobs=JOBS), timeout_s=30, load_timeout_s=60)
        assert isinstance(m, Measured) and w.pid != first and not w.cold


def test_crash_and_out_of_memory_restart_the_worker(target):
    path = target({"oom_above_mb": 1000})
    spec = LoadSpec(target=path)
    with EngineWorker(FAKE) as w:
        with pytest.raises(WorkerError, match="CUDA out of memory") as info:
            w.request(Measure(spec=spec, jobs=JOBS, expert_budget_mb=4096), timeout_s=30, load_timeout_s=60)
        assert info.value.kind == "oom" and not w.alive
        m = w.request(Measure(spec=spec, jobs=JOBS, expert_budget_mb=512), timeout_s=30, load_timeout_s=60)
        assert m.outputs[0].timings["peak_mem_mb"] == 612.0
    crashing = target({"crash_on_generate": True})
    with EngineWorker(FAKE) as w:
        with pytest.raises(WorkerError, match="exited with status 4") as info:
            w.request(Measure(spec=LoadSpec(target=crashing), jobs=JOBS), timeout_s=30, load_timeout_s=60)
        assert info.value.kind == "crash"


def test_engine_options_reach_the_loader():
    """A LoadSpec's options ([engine] of the config) are passed to the engine factory, and a
    spec that differs only in them is a reload."""
    from types import SimpleNamespace

    from tuner.worker import _EngineHost

    seen = []
    host = _EngineHost(lambda path, **kw: seen.append((path, kw)) or SimpleNamespace(device="cpu"),
                       SimpleNamespace(send=lambda message: None))
    options = (("cold_format", "quantized"), ("cuda_graph", True), ("hot_format", "quantized"))
    spec = LoadSpec(target="t.gguf", options=options)
    assert host.ensure(spec, 512) and not host.ensure(spec, 512)
    assert seen == [("t.gguf", {"device": "auto", "expert_budget_mb": 512, "cold_format": "quantized",
                                "cuda_graph": True, "hot_format": "quantized"})]
    assert host.ensure(LoadSpec(target="t.gguf"), 512) and seen[-1][1] == {"device": "auto", "expert_budget_mb": 512}


def test_the_cold_cpu_share_is_set_before_measuring_and_put_back_after():
    """A Measure's CPU share reaches the engine before its generations, again after each (a budget change
    places the experts anew), and 0 once a Measure carries none; a fresh load starts from 0."""
    from types import SimpleNamespace

    from tuner.worker import _EngineHost

    calls = []
    engine = SimpleNamespace(device="cpu", set_cold_cpu_share=calls.append)
    host = _EngineHost(lambda path, **kw: engine, SimpleNamespace(send=lambda message: None))
    host.ensure(LoadSpec(target="t.gguf"), 512)
    host.share(None)
    assert calls == []
    host.share(0.5)
    host.share(0.5)
    host.share(None)
    host.share(None)
    assert calls == [0.5, 0.5, 0.0]


def test_cold_experts_ahead_are_set_where_they_change():
    """A Measure's counts fetched and warmed ahead reach the engine where they differ from what it has (None: 0);
    a fresh load starts from none."""
    from types import SimpleNamespace

    from tuner.worker import _EngineHost

    calls = []
    engine = SimpleNamespace(device="cpu", set_cold_prefetch=lambda n, *, warm: calls.append((n, warm)))
    host = _EngineHost(lambda path, **kw: engine, SimpleNamespace(send=lambda message: None))
    host.ensure(LoadSpec(target="t.gguf"), 512)
    host.fetch_ahead(None, None)
    assert calls == []
    host.fetch_ahead(2, None)
    host.fetch_ahead(2, 0)
    host.fetch_ahead(2, 1)
    host.fetch_ahead(None, None)
    assert calls == [(2, 0), (2, 1), (0, 0)]
    host.fetch_ahead(1, 1)
    host.ensure(LoadSpec(target="other.gguf"), 512)  # a fresh engine: nothing set on it yet
    host.fetch_ahead(1, 1)
    assert calls[-2:] == [(1, 1), (1, 1)]


def test_the_placement_unit_reaches_the_budget_and_the_load():
    """A Measure's placement unit goes to the load's options on a fresh load, and to ``set_expert_budget`` when the
    budget or the unit changes on a loaded engine; without one the budget is set as before."""
    from types import SimpleNamespace

    from tuner.worker import _EngineHost

    loads, budgets = [], []
    engine = SimpleNamespace(device="cpu", set_expert_budget=lambda mb, **kw: budgets.append((mb, kw)))
    host = _EngineHost(lambda path, **kw: loads.append(kw) or engine, SimpleNamespace(send=lambda message: None))
    spec = LoadSpec(target="t.gguf")
    assert host.ensure(spec, 512, "layer") and loads[-1]["placement_unit"] == "layer"
    assert not host.ensure(spec, 512, "layer") and budgets == []
    host.ensure(spec, 512, "expert")
    host.ensure(spec, 768, None)
    host.ensure(spec, 768, "expert")
    assert budgets == [(512, {"unit": "expert"}), (768, {"unit": None})]
    assert host.ensure(LoadSpec(target="u.gguf"), 512) and "placement_unit" not in loads[-1]


def test_the_cold_cpu_share_reaches_the_worker_engine(target):
    spec = LoadSpec(target=target())
    with EngineWorker(FAKE) as w:
        m = w.request(Measure(spec=spec, jobs=JOBS, cold_cpu_share=0.5), timeout_s=30, load_timeout_s=60)
        assert all(o.timings["cold_cpu_share"] == 0.5 for o in m.outputs)
        m = w.request(Measure(spec=spec, jobs=JOBS), timeout_s=30, load_timeout_s=60)
        assert all("cold_cpu_share" not in o.timings for o in m.outputs)
        m = w.request(Measure(spec=spec, jobs=JOBS, expert_budget_mb=256, placement_unit="layer"), timeout_s=30,
                      load_timeout_s=60)
        assert all(o.timings["placement_unit"] == "layer" for o in m.outputs)
