"""Engine.generate through the static decode step: same tokens as eager decoding, one cached
step per state size, reset between requests, dropped when the experts move; the CLI flag.

On the CPU the engine decodes eagerly (nothing to capture), so these tests lift its blocker
to run the static step uncaptured ("static"); on CUDA the step is captured ("cuda_graph").
Greedy identity on CUDA is asserted in float32, where the two paths differ by summation
order only; in bf16 a near tie between two logits may break either way.
"""

import json

import pytest
import torch

from engine.engine import GRAPH_MIN_TOKENS, Engine, graph_capacity
from engine.gguf.make_model import make_model
from engine.placement import MB
from tuner.cli import main

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("graph") / "tiny.gguf", "tiny", seed=5, n_layers=8)


@pytest.fixture
def eng(tiny):
    return Engine.from_gguf(tiny, device="cpu")


def static_on_cpu(monkeypatch, eng):
    monkeypatch.setattr(eng, "decode_graph_blocker", lambda: None)


def test_prompts_prefill_padded_and_the_tokens_stay_the_same(monkeypatch, eng):
    """With the step's blocker lifted, prompts prefill through the padded prefill (uncaptured on the CPU)
    from the second prompt of a padded length on (``prefill_capture_after``), one cached per length, and
    generate the eager tokens; past the longest length, or switched off, the prefill is eager."""
    from engine.model import prefill_graph

    prompts = [eng.tokenizer.encode("def add(a, b):\n"), eng.tokenizer.encode("import os\n" * 30)]
    eager = [eng.generate(p, 6, ignore_eos=True) for p in prompts]
    assert all(g.timings.extra["prefill_path"] == "eager" for g in eager)
    static_on_cpu(monkeypatch, eng)
    assert eng.prefill_graph and eng.prefill_capture_after == 1  # the defaults
    first = [eng.generate(p, 6, ignore_eos=True) for p in prompts]
    assert [g.timings.extra["prefill_path"] for g in first] == ["eager", "eager"] and not eng._prefills
    padded = [eng.generate(p, 6, ignore_eos=True) for p in prompts]
    assert [g.ids for g in padded] == [g.ids for g in eager]
    assert [g.timings.extra["prefill_path"] for g in padded] == ["padded", "padded"]
    assert sorted(eng._prefills) == sorted({prefill_graph.bucket_for(len(p)) for p in prompts})
    one = eng.generate(prompts[0], 1, ignore_eos=True)  # no decode step: the prefill's own state
    assert one.ids == eager[0].ids[:1]
    monkeypatch.setattr(prefill_graph, "BUCKETS", (8,))
    assert eng.generate(prompts[1], 2, ignore_eos=True).timings.extra["prefill_path"] == "eager"
    eng.prefill_graph = False
    assert eng.generate(prompts[0], 2, ignore_eos=True).timings.extra["prefill_path"] == "eager"
    monkeypatch.undo()
    static_on_cpu(monkeypatch, eng)
    eng.prefill_graph, eng.prefill_capture_after = True, 0  # captured on first use
    fresh = eng.tokenizer.encode("x = 1\n" * 200)  # a length not seen before
    assert eng.generate(fresh, 2, ignore_eos=True).timings.extra["prefill_path"] == "padded"


def test_capacity_buckets():
    assert graph_capacity(1) == graph_capacity(GRAPH_MIN_TOKENS) == GRAPH_MIN_TOKENS
    assert graph_capacity(GRAPH_MIN_TOKENS + 1) == 2 * GRAPH_MIN_TOKENS
    assert graph_capacity(5000) == 6144 and graph_capacity(6145) == 8192
    assert graph_capacity(133_000) == 196_608
    for n in range(1, 300_000, 997):
        assert n <= graph_capacity(n) < n + max(GRAPH_MIN_TOKENS, n / 2)


def test_cpu_decodes_eagerly_and_says_why(eng):
    assert eng.cuda_graph  # on by default
    g = eng.generate(eng.tokenizer.encode("x = 1"), 4, ignore_eos=True)
    assert g.timings.extra["decode_path"] == "eager"
    assert "not on a CUDA device" in g.timings.extra["decode_graph_blocker"]
    assert eng._graphs == {}


def test_greedy_and_seeded_tokens_are_the_same_through_the_static_step(monkeypatch, eng):
    prompts = [eng.tokenizer.encode("def add(a, b):\n"), eng.tokenizer.encode("import os\nimport sys\n")]
    eager = [eng.generate(p, 12, ignore_eos=True) for p in prompts]
    sampled = eng.generate(prompts[0], 12, temperature=0.8, seed=3, ignore_eos=True)
    static_on_cpu(monkeypatch, eng)
    first = eng.generate(prompts[0], 12, ignore_eos=True)
    assert first.ids == eager[0].ids
    assert first.timings.extra["decode_path"] == "static"
    assert "decode_graph_capture_s" in first.timings.extra
    (step,) = eng._graphs.values()
    assert step.state.max_len == GRAPH_MIN_TOKENS
    # the next requests reuse the step and its state, reset in between
    second = eng.generate(prompts[1], 12, ignore_eos=True)
    assert second.ids == eager[1].ids and "decode_graph_capture_s" not in second.timings.extra
    assert eng.generate(prompts[0], 12, temperature=0.8, seed=3, ignore_eos=True).ids == sampled.ids
    assert list(eng._graphs.values()) == [step]


def test_decoding_after_a_compressed_prefill_goes_through_the_static_step(monkeypatch, tmp_path, tiny):
    """PFlash prefills a state of its own (kept chunks at their original positions); the static
    step continues from a copy of it and gives the eager tokens."""
    drafter = make_model(tmp_path / "drafter.gguf", "tiny", seed=11, n_layers=4)
    eng = Engine.from_gguf(tiny, device="cpu", drafter=drafter, pflash_threshold=16)
    ids = torch.randint(0, eng.config.vocab - 1, (96,), generator=torch.Generator().manual_seed(2)).tolist()
    eager = eng.generate(ids, 10, ignore_eos=True, pflash_keep_ratio=0.3)
    assert eager.timings.extra["decode_path"] == "eager" and eager.timings.extra["pflash_kept_tokens"] < len(ids)
    static_on_cpu(monkeypatch, eng)
    static = eng.generate(ids, 10, ignore_eos=True, pflash_keep_ratio=0.3)
    assert static.timings.extra["decode_path"] == "static"
    assert static.ids == eager.ids
    (step,) = eng._graphs.values()
    assert step.state.seq_len == eager.timings.extra["pflash_kept_tokens"] + 9
    assert step.state.next_position == len(ids) + 9  # positions continue from the full prompt's


def test_a_new_expert_budget_drops_the_cached_steps(monkeypatch, eng):
    ids = eng.tokenizer.encode("for i in range(10):\n")
    eager = eng.generate(ids, 8, ignore_eos=True)
    static_on_cpu(monkeypatch, eng)
    assert eng.generate(ids, 8, ignore_eos=True).ids == eager.ids
    assert len(eng._graphs) == 1
    eng.set_expert_budget(1e6)  # everything hot
    assert eng._graphs == {}
    g = eng.generate(ids, 8, ignore_eos=True)
    assert g.ids == eager.ids and g.timings.extra["decode_path"] == "static"
    (step,) = eng._graphs.values()
    assert step.executor is eng.hybrid
    k, layers = eng.config.n_expert_used, eng.config.n_layers
    assert g.timings.extra["hot_hits"] == (len(ids) + 7) * k * layers and g.timings.extra["cold_hits"] == 0
    eng.hybrid.close()


def test_a_failed_capture_falls_back_to_eager_decoding_once(monkeypatch, eng):
    from engine.model import decode_graph

    ids = eng.tokenizer.encode("while True:\n")
    eager = eng.generate(ids, 6, ignore_eos=True)
    attempts = []

    def fail(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graph, "DecodeGraph", fail)
    monkeypatch.setattr(eng, "_capture_failures", {})
    monkeypatch.setattr(Engine, "decode_graph_blocker",  # as on a CUDA device that allows capture
                        lambda self: self._capture_failures.get("decode"))
    with pytest.warns(UserWarning, match="capturing the decode step failed"):
        g = eng.generate(ids, 6, ignore_eos=True)
    assert g.ids == eager.ids and g.timings.extra["decode_path"] == "eager"
    again = eng.generate(ids, 6, ignore_eos=True)
    assert "not permitted" in again.timings.extra["decode_graph_blocker"]
    assert len(attempts) == 1 and eng._graphs == {}


def test_cli_flag_keeps_decoding_eager(tiny, capsys):
    assert main(["generate", "-m", str(tiny), "-p", "hello", "-n", "3", "--device", "cpu", "--json",
                 "--no-cuda-graph"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["timings"]["decode_path"] == "eager"
    assert out["timings"]["decode_graph_blocker"] == "the engine was loaded with cuda_graph=False"


def test_cli_timings_name_the_prefill_path(tiny, capsys):
    from engine.cli import _prefill_path

    assert main(["generate", "-m", str(tiny), "-p", "hello", "-n", "3", "--device", "cpu"]) == 0
    assert "tok/s, eager) | decode" in " ".join(capsys.readouterr().err.split())  # rich wraps at 80 columns
    assert _prefill_path({"prefill_path": "cuda_graph", "prefill_padded_to": 512}) == ", cuda_graph padded to 512"
    assert _prefill_path({"decode_path": "eager"}) == ""  # a DFlash or PFlash prefill


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("weights", ["dense", "quantized"])
def test_cuda_greedy_text_is_identical_with_and_without_the_graph(tmp_path, weights):
    path = make_model(tmp_path / "tiny.gguf", "tiny", seed=5, n_layers=8,
                      quant="q8_0" if weights == "quantized" else "f32")
    eng = Engine.from_gguf(path, device="cuda", dtype="float32", weights=weights, cuda_graph=True)
    eng.prefill_graph = True
    eng.prefill_capture_after = 0
    ids = eng.tokenizer.encode("def fibonacci(n):\n")
    long_ids = eng.tokenizer.encode("values = [1, 2, 3]\n" * 30)  # 360 tokens: the captured prefill of 384
    graph = eng.generate(ids, 32, ignore_eos=True)
    assert graph.timings.extra["decode_path"] == "cuda_graph", graph.timings.extra.get("decode_graph_blocker")
    assert graph.timings.extra["prefill_path"] == "cuda_graph", graph.timings.extra.get("prefill_graph_blocker")
    again = eng.generate(ids, 32, ignore_eos=True)
    assert "decode_graph_capture_s" not in again.timings.extra and "prefill_graph_capture_s" not in again.timings.extra
    graph_long = eng.generate(long_ids, 16, ignore_eos=True)
    assert graph_long.timings.extra["prefill_padded_to"] == 384
    eng.cuda_graph = False
    eager = eng.generate(ids, 32, ignore_eos=True)
    assert eager.timings.extra["decode_path"] == eager.timings.extra["prefill_path"] == "eager"
    assert graph.ids == again.ids == eager.ids and graph.text == eager.text
    assert graph_long.ids == eng.generate(long_ids, 16, ignore_eos=True).ids


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_through_an_all_hot_hybrid_placement(tmp_path):
    """Every expert hot: the captured step runs the hybrid executor's Triton fused-MoE kernels
    and its device-side hit counters count every replayed pair; with cold experts the engine
    decodes eagerly and says why."""
    path = make_model(tmp_path / "tiny.gguf", "tiny", seed=6, n_layers=8, n_expert=16)
    eng = Engine.from_gguf(path, device="cuda", dtype="float32", cuda_graph=True)
    ids = eng.tokenizer.encode("class Stack:\n")
    eng.cuda_graph = False
    plain = eng.generate(ids, 24, ignore_eos=True)
    eng.cuda_graph = True
    placement = eng.set_expert_budget(1e6)
    assert placement.cold_count == 0 and eng.hybrid.graph_safe
    g = eng.generate(ids, 24, ignore_eos=True)
    assert g.timings.extra["decode_path"] == "cuda_graph"
    assert g.ids == plain.ids
    k, layers = eng.config.n_expert_used, eng.config.n_layers
    assert g.timings.extra["hot_hits"] == (len(ids) + 23) * k * layers and g.timings.extra["cold_hits"] == 0
    assert eng.set_expert_budget(0.5 * placement.hot_bytes / MB).cold_count > 0
    cold = eng.generate(ids, 8, ignore_eos=True)
    assert cold.timings.extra["decode_path"] == "eager"
    assert "HybridExperts needs the host" in cold.timings.extra["decode_graph_blocker"]
    assert cold.ids == plain.ids[:8]
    eng.hybrid.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_tokens_are_the_same_with_the_loads_before_the_wait_and_without(monkeypatch, tmp_path):
    """The captured step with the decode kernels loading before their PDL wait (the router's rows, the delta
    rule's state, the down launch's ids and codes) decodes the tokens it decodes with them loading after it,
    and with PDL off: a load that raced a write of the launch before would change them."""
    from engine.kernels import pdl

    path = make_model(tmp_path / "tiny.gguf", "tiny", seed=7, n_layers=8, quant="q4_0")
    ids = None
    runs = {}
    for name, enabled, prefetch in (("prefetch", None, True), ("after the wait", None, False), ("no PDL", False, False)):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        monkeypatch.setattr(pdl, "PREFETCH", prefetch)
        eng = Engine.from_gguf(path, device="cuda", dtype="float32", weights="quantized", cold_format="quantized",
                               hot_format="quantized", expert_budget_mb=0, cuda_graph=True)
        placement = eng.set_expert_budget(0)
        eng.set_expert_budget(placement.n_expert * sum(placement.expert_bytes) / 2**20)  # every expert hot
        ids = ids or eng.tokenizer.encode("def merge(a, b):\n")
        out = eng.generate(ids, 48, ignore_eos=True)
        assert out.timings.extra["decode_path"] == "cuda_graph", out.timings.extra.get("decode_graph_blocker")
        runs[name] = out.ids
    assert runs["prefetch"] == runs["after the wait"] == runs["no PDL"]


@pytest.mark.gpu
@needs_cuda
def test_cuda_blocking_wait_decodes_the_same_tokens(monkeypatch, tmp_path):
    """``LUCE_TUNE_BLOCKING_WAIT=1``: the captured decode loop's wait for each token sleeps on a blocking event
    instead of spinning, and the tokens are the ones the spinning wait reads."""
    from engine.engine import BLOCKING_WAIT_ENV, _TokenReader

    path = make_model(tmp_path / "tiny.gguf", "tiny", seed=8, n_layers=8, quant="q8_0")
    eng = Engine.from_gguf(path, device="cuda", dtype="float32", weights="quantized", cuda_graph=True)
    ids = eng.tokenizer.encode("def merge(a, b):\n")
    monkeypatch.delenv(BLOCKING_WAIT_ENV, raising=False)
    spin = eng.generate(ids, 40, ignore_eos=True)
    monkeypatch.setenv(BLOCKING_WAIT_ENV, "1")
    sleep = eng.generate(ids, 40, ignore_eos=True)
    assert spin.timings.extra["decode_path"] == sleep.timings.extra["decode_path"] == "cuda_graph"
    assert sleep.ids == spin.ids
    # the process's first blocking wait made while the device was busy, once, before the first step
    assert any(d.type == "cuda" for d in _TokenReader._warmed)
    reader = _TokenReader(torch.device("cuda"), blocking=True)
    # created (and waited on once) before any step: no first use of a blocking event while a step runs
    assert all(event.cuda_event != 0 and event.query() for event in reader.events)
    assert torch.device("cuda") in _TokenReader._warmed
    slot = reader.put(torch.tensor(11, device="cuda") * 3)
    assert reader.blocking and reader.get(slot) == 33
