"""The hybrid executor with ``cold_device="gpu"``: the device computes the cold experts from
their host copies (read in place for short calls, copied in runs of experts for long ones).

On the CPU the "device" is the CPU and the mapped view is the host tensor itself, so these
tests check the routing of pairs between tiers, the runs and the counters against the CPU
threads' path; on CUDA, the view over pinned memory and the captured step with cold experts.

Bounds: float32 throughout (the CPU tier in its exact float32 path), so both placements
compute the same maths in other summation orders: logits within 1e-5 of the largest.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are decorated

import engine.hybrid as hybrid_module  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.gguf.reader import GGUFFile  # noqa: E402
from engine.hybrid import attach_hybrid, mapped_view  # noqa: E402
from engine.model.decode_graph import DecodeGraph, graph_blocker  # noqa: E402
from engine.model.qwen35moe import Qwen35MoE  # noqa: E402
from engine.model.weights import raw_experts  # noqa: E402
from engine.placement import MB  # noqa: E402
from tests.engine.steps import follow_captured  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = 1e-5


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    from engine.gguf.make_model import make_model

    return make_model(tmp_path_factory.mktemp("cold_device") / "tiny_q4_0.gguf", "tiny", n_expert=16,
                      quant="q4_0", router_skew=1.0, seed=5)


def load(path, device="cpu"):
    with GGUFFile(path) as f:
        return Qwen35MoE.from_gguf(f, device=device, dtype=torch.float32)


def dense_mb(model):
    return sum(t.numel() * t.element_size() for layer in model.weights.layers
               for t in (layer.moe.experts.gate, layer.moe.experts.up, layer.moe.experts.down)) / MB


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def attach(path, fmt, fraction, cold_device, device="cpu", impl="auto"):
    model = load(path, device)
    options = {}
    if fmt == "quantized":
        options = dict(cold_format="quantized", gguf_file=GGUFFile(path), cold_dtype=torch.float32)
    hybrid = attach_hybrid(model, fraction * dense_mb(load(path)), None, threads=2, cold_device=cold_device,
                           impl=impl, **options)
    return model, hybrid


def run(model, ids, decode=4):
    """Logits of a prompt (one long call) and then of ``decode`` tokens one at a time."""
    state = model.new_state(len(ids) + decode)
    prompt = model.forward(ids, state, logits="all").logits
    steps = [model.forward(ids[i:i + 1], state, logits="last").logits for i in range(decode)]
    return prompt, torch.cat(steps)


@pytest.mark.parametrize("fmt", ["dense", "quantized"])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_device_cold_tier_matches_the_cpu_threads(q4_file, fmt, fraction, monkeypatch):
    """The 11-token prompt routes 22 pairs over 16 experts, so it copies the cold experts in
    runs (of at most 3 here, so several per layer); the single tokens read them in place. No
    CPU thread computes anything, and the hit counters agree with the CPU tier's."""
    monkeypatch.setattr(hybrid_module, "STREAM_EXPERTS", 3)
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(1))
    model, threads = attach(q4_file, fmt, fraction, "cpu")
    ref = run(model, ids)
    ref_snap = threads.stats_snapshot()
    threads.close()

    model, device = attach(q4_file, fmt, fraction, "gpu")
    calls = []
    real = hybrid_module.HybridExperts._cold_on_device

    def spy(self, layer, x, ids, w, *rest):
        calls.append(x.shape[0])
        return real(self, layer, x, ids, w, *rest)

    def no_threads(*_):
        raise AssertionError("the CPU threads computed cold experts")

    monkeypatch.setattr(hybrid_module.HybridExperts, "_cold_on_device", spy)
    monkeypatch.setattr(hybrid_module.HybridExperts, "_cold", no_threads)
    out = run(model, ids)
    snap = device.stats_snapshot()
    for a, b in zip(out, ref):
        assert rel_err(a, b) < TOL
    assert (snap.hot_hits, snap.cold_hits) == (ref_snap.hot_hits, ref_snap.cold_hits) and snap.cold_hits > 0
    assert set(calls) == {11, 1}
    assert all(len(layer.cold_runs) >= 2 for layer in device._layers)
    device.close()


def test_quantized_device_tier_holds_the_blocks_and_packs_nothing(q4_file):
    model, device = attach(q4_file, "quantized", 0.5, "gpu")
    with GGUFFile(q4_file) as f:
        blocks = sum(r.data.nbytes for layer in raw_experts(f, model.cfg) for r in layer)
    assert all(layer.host._matrices is None for layer in device._layers)
    assert device.expert_host_bytes == blocks
    device.close()


def test_cold_runs_split_at_hot_experts_and_at_the_run_length(monkeypatch):
    assert hybrid_module._cold_runs([True, False, False, True, False]) == [(1, 2), (4, 1)]
    assert hybrid_module._cold_runs([True, True]) == []
    monkeypatch.setattr(hybrid_module, "STREAM_EXPERTS", 2)
    assert hybrid_module._cold_runs([False] * 5) == [(0, 2), (2, 2), (4, 1)]


def test_a_device_cold_tier_is_graph_safe_and_its_static_step_matches_eager(q4_file):
    """With the Triton kernels (the interpreter here) and cold experts computed on the device,
    nothing waits for the host: the step is capturable, and run statically it gives the eager
    logits of the all-hot model, for single tokens and for a 9-token block (18 pairs: copied)."""
    pytest.importorskip("triton")
    plain = load(q4_file)
    model, hybrid = attach(q4_file, "dense", 0.5, "gpu", impl="triton")
    assert hybrid.graph_safe
    stand_in = type("M", (), {"device": torch.device("cuda"), "executor": hybrid, "routing_observer": None})
    assert graph_blocker(stand_in) is None
    _, threads = attach(q4_file, "dense", 0.5, "cpu", impl="triton")
    assert not threads.graph_safe and "needs the host" in graph_blocker(
        type("M", (), {"device": torch.device("cuda"), "executor": threads, "routing_observer": None}))
    threads.close()

    ids = torch.randint(0, 256, (5 + 2 + 9,), generator=torch.Generator().manual_seed(4))
    eager, static = plain.new_state(16), model.new_state(16)
    plain.forward(ids[:5], eager, logits="none")
    model.forward(ids[:5], static, logits="none")
    hybrid.reset_counters()
    one = DecodeGraph(model, static, kernels="triton")
    for t in (5, 6):
        ref = plain.forward(ids[t:t + 1], eager, logits="last").logits
        assert rel_err(one.step(ids[t:t + 1]), ref) < 1e-4
    block = DecodeGraph(model, static, tokens=9, kernels="triton")
    ref = plain.forward(ids[7:16], eager, logits="all").logits
    assert rel_err(block.step(ids[7:16]), ref) < 1e-4
    assert hybrid.stats_snapshot().cold_hits > 0
    hybrid.close()


def test_mapped_view_on_a_cpu_device_is_the_tensor_itself():
    t = torch.arange(6.0)
    assert mapped_view(t, torch.device("cpu")) is t


def test_engine_and_cli_options(q4_file, capsys):
    from engine.engine import Engine
    from tuner.cli import main

    with pytest.raises(ConfigError, match="cold_device must be 'cpu' or 'gpu', got 'tpu'"):
        Engine.from_gguf(q4_file, device="cpu", cold_device="tpu")
    status = main(["generate", "--model", str(q4_file), "--prompt", "hi", "--device", "cpu", "--cold-device", "gpu"])
    assert status == 2 and "--cold-device needs --expert-budget" in capsys.readouterr().err

    prompt = [3, 17, 5, 99, 42, 7]
    threads = Engine.from_gguf(q4_file, device="cpu", expert_budget_mb=0)
    device = Engine.from_gguf(q4_file, device="cpu", expert_budget_mb=0, cold_device="gpu")
    assert device.hybrid.cold_device == "gpu"
    a, b = device.generate(prompt, 5), threads.generate(prompt, 5)
    assert a.ids == b.ids and a.timings.extra["cold_hits"] == b.timings.extra["cold_hits"] > 0
    threads.hybrid.close()
    device.hybrid.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_mapped_view_reads_pinned_host_memory():
    host = torch.arange(1000, dtype=torch.float32).pin_memory()
    view = mapped_view(host, torch.device("cuda"))
    assert view.is_cuda and view.data_ptr() == host.data_ptr() and view.shape == host.shape
    assert view.sum().item() == host.sum().item()
    host[7] = -1.0  # the device reads the host memory itself, not a copy
    assert view[7].item() == -1.0
    with pytest.raises(ValueError, match="pinned"):
        mapped_view(torch.zeros(4), torch.device("cuda"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["dense", "quantized"])
def test_cuda_graph_captures_a_step_with_cold_experts(q4_file, fmt):
    """Half the experts cold, computed on the device from pinned host memory: the step is
    captured, and its logits follow the all-on-device model's, teacher-forced."""
    plain = load(q4_file, "cuda")
    model, hybrid = attach(q4_file, fmt, 0.5, "gpu", device="cuda")
    assert hybrid.graph_safe and hybrid.placement.cold_count > 0
    follow_captured(plain, model, 1e-3, before=hybrid.reset_counters)  # the 7-token prompt: the copied runs
    assert hybrid.stats_snapshot().cold_hits > 0
    hybrid.close()


@pytest.mark.parametrize("cold_device", ["cpu", "gpu"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_split_row_layout_gives_the_same_logits(q4_file, cold_device, impl):
    """Hot slots (and with ``cold_device="gpu"`` the host copies) in the split row layout, as on
    CUDA: the same logits as the file's block order, through the references and the kernels."""
    if impl == "triton":
        pytest.importorskip("triton")
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(3))  # 22 pairs: copied runs
    runs = []
    for split in (False, True):
        model = load(q4_file)
        with GGUFFile(q4_file) as f:
            budget = 0.5 * sum(r.data.nbytes for layer in raw_experts(f, model.cfg) for r in layer) / MB
        hybrid = attach_hybrid(model, budget, None, threads=2, cold_format="quantized", hot_format="quantized",
                               gguf_file=GGUFFile(q4_file), cold_dtype=torch.float32, cold_device=cold_device,
                               impl=impl, split=split)
        layer = hybrid._layers[0]
        assert {e.layout for e in layer.slot_experts} == {"split" if split else "ggml"}
        if cold_device == "gpu":
            assert {e.layout for e in layer.mapped} == {"split" if split else "ggml"}
        runs.append(run(model, ids, decode=3))
        hybrid.close()
    for a, b in zip(*runs):
        assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("fmt", ["dense", "blocks"])
def test_decode_gathers_the_routed_cold_experts_first(q4_file, fmt, monkeypatch):
    """Decode-sized calls copy each routed pair's cold expert into the stream buffers in one launch
    (``engine.kernels.gather``) and the expert launches read it there: the same logits as reading the
    experts in place, the gather taken at every single-token call (2 pairs) and not for the prompt (22
    pairs: runs of experts); dense experts, and Q4_0 blocks on both tiers."""
    pytest.importorskip("triton")
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(4))
    runs, gathered = [], []
    real = hybrid_module.HybridExperts._gathered

    def spy(self, layer, cold_ids):
        out = real(self, layer, cold_ids)
        gathered.append((cold_ids.shape[0], out is not None))
        return out

    monkeypatch.setattr(hybrid_module.HybridExperts, "_gathered", spy)
    for gather in (False, True):
        monkeypatch.setattr(hybrid_module, "COLD_GATHER", gather)
        gathered.clear()
        if fmt == "dense":
            model, hybrid = attach(q4_file, fmt, 0.5, "gpu", impl="triton")
        else:
            model = load(q4_file)
            with GGUFFile(q4_file) as f:
                budget = 0.5 * sum(r.data.nbytes for layer in raw_experts(f, model.cfg) for r in layer) / MB
            hybrid = attach_hybrid(model, budget, None, threads=2, cold_format="quantized", hot_format="quantized",
                                   gguf_file=GGUFFile(q4_file), cold_dtype=torch.float32, cold_device="gpu",
                                   impl="triton", split=True)
        runs.append(run(model, ids, decode=3))
        assert hybrid.stats_snapshot().cold_hits > 0
        hybrid.close()
    assert {t for t, taken in gathered if taken} == {1} and not [t for t, taken in gathered if t == 1 and not taken]
    for a, b in zip(*runs):
        assert rel_err(a, b) < 1e-6


def test_host_memory_the_device_cannot_read_is_one_clear_error(q4_file, monkeypatch):
    def refuse(t, device):
        raise RuntimeError("pointer is not registered with the device")

    monkeypatch.setattr(hybrid_module, "mapped_view", refuse)
    with pytest.raises(ConfigError, match="cold_device='gpu': cpu cannot read the experts' host copies in place "
                                          r"\(pointer is not registered with the device\); use cold_device='cpu'"):
        attach(q4_file, "dense", 0.5, "gpu")


def test_decode_with_cold_experts_in_five_launches(q4_file, monkeypatch):
    """Q4_0 projections and experts, half of them cold: each decode-sized call splits its pairs between the
    device slots and the stage stacks (``engine.kernels.hybrid_split``), copies the bus's experts into the
    stage (``gather_stacks``) and runs one pair of expert launches over both with the shared expert inside
    (``HybridExperts._staged_moe``): the same logits as the launches apart (``LUCE_TUNE_HYBRID_STAGED=0``),
    the same hit counters, and the prompt (22 pairs, more than the stage's 16 rows) is not taken."""
    pytest.importorskip("triton")
    monkeypatch.setattr(hybrid_module, "COLD_GATHER", True)
    monkeypatch.setattr(hybrid_module, "STREAM_EXPERTS", 16)
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(4))
    taken = []
    real = hybrid_module.HybridExperts._staged_moe

    def spy(self, layer_idx, x, *rest):
        out = real(self, layer_idx, x, *rest)
        taken.append((x.shape[0], out is not None))
        return out

    monkeypatch.setattr(hybrid_module.HybridExperts, "_staged_moe", spy)
    results = []
    for staged in ("1", "0"):
        monkeypatch.setenv(hybrid_module.STAGED_ENV, staged)
        with GGUFFile(q4_file) as f:
            model = Qwen35MoE.from_gguf(f, dtype=torch.float32, quantized=True)
            budget = 0.5 * sum(r.data.nbytes for layer in raw_experts(f, model.cfg) for r in layer) / MB
        hybrid = attach_hybrid(model, budget, None, threads=2, cold_format="quantized", hot_format="quantized",
                               gguf_file=GGUFFile(q4_file), cold_dtype=torch.float32, cold_device="gpu",
                               impl="triton")
        assert 0 < hybrid.placement.hot_count < hybrid.placement.hot_count + hybrid.placement.cold_count
        results.append((run(model, ids, decode=3), hybrid.stats_snapshot()))
        hybrid.close()
        if staged == "1":
            assert {t for t, ok in taken if ok} == {1} and {t for t, ok in taken if not ok} == {11}
        else:
            assert taken and not any(ok for _, ok in taken)
        taken.clear()
    (staged, snap), (apart, ref) = results
    for a, b in zip(staged, apart):
        assert rel_err(a, b) < TOL
    assert snap.cold_hits == ref.cold_hits > 0 and snap.hot_hits == ref.hot_hits > 0
