"""The one-launch router (logits and top-k), SwiGLU and shared-expert sum against
the torch definitions: odd expert counts and widths, ties, strided rows, bf16; then a model's
logits with the fused path against the reference path. On the CPU through the Triton
interpreter, on CUDA compiled."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated

from engine.kernels import warps as warps_table  # noqa: E402
from engine.model import moe  # noqa: E402

kernels = pytest.importorskip("engine.kernels.moe_gate")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_route(logits, k):
    probs = torch.softmax(logits, dim=-1)
    w, ids = probs.topk(k, dim=-1)
    return ids, w / w.sum(-1, keepdim=True)


def route_of_logits(logits, k, warps=None):
    """The router's top-k of given logits: x the logits, the router the identity (exact in float32)."""
    return kernels.route_triton(logits, torch.eye(logits.shape[1], device=logits.device), k, num_warps=warps)


@pytest.mark.parametrize("warps", [1, 4])
@pytest.mark.parametrize("T, E, k", [(1, 8, 2), (3, 37, 4), (16, 256, 8), (5, 130, 1), (2, 1000, 8), (4, 8, 8)])
def test_route_topk_matches_softmax_topk_renormalised(T, E, k, warps):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(E + k)).to(DEVICE) * 4
    ids, w = route_of_logits(logits, k, warps)
    ref_ids, ref_w = reference_route(logits, k)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("warps", [1, 4])
def test_route_ties_go_to_the_lower_id_and_strided_rows_are_read(warps):
    wide = torch.zeros(3, 40, device=DEVICE)
    wide[:, 5] = wide[:, 9] = wide[:, 2] = 3.0  # a three-way tie at the top
    logits = wide[:, :20]  # rows strided by 40
    ids, w = route_of_logits(logits, 2, warps)
    assert ids.tolist() == [[2, 5]] * 3
    torch.testing.assert_close(w, torch.full((3, 2), 0.5, device=DEVICE))
    ids, w = route_of_logits(torch.zeros(2, 37, device=DEVICE), 4, warps)  # every logit equal
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(w, torch.full((2, 4), 0.25, device=DEVICE))


def test_route_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="power of two"):
        route_of_logits(torch.randn(2, 16, device=DEVICE), 3)
    with pytest.raises(ValueError, match="k <= E"):
        route_of_logits(torch.randn(2, 4, device=DEVICE), 8)


def reference_logits_route(x, router, k):
    return reference_route(F.linear(x.float(), router), k)


@pytest.mark.parametrize("T, E, H, k", [(1, 60, 200, 2), (3, 60, 200, 8), (16, 60, 37, 1), (1, 256, 200, 8),
                                        (3, 256, 2048, 8), (16, 256, 200, 8), (2, 8, 5, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_from_x_matches_the_reference_twice(T, E, H, k, dtype):
    g = torch.Generator().manual_seed(T * E + H + k)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    router = torch.randn(E, H, generator=g).to(DEVICE) * H ** -0.5 * 4
    ref_ids, ref_w = reference_logits_route(x, router, k)
    ids, w = kernels.route_triton(x, router, k)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (T, k)
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    again = kernels.route_triton(x, router, k)  # the counters were left at zero
    assert torch.equal(again[0], ids) and torch.equal(again[1], w)
    other = kernels.route_triton(x, router, k, num_warps=8 // warps_table.warps("router"))  # another split of the logits
    assert torch.equal(other[0], ids)
    torch.testing.assert_close(other[1], w, rtol=1e-6, atol=1e-7)


def test_side_and_ahead_routes_use_scratch_of_their_own():
    """``side=True`` (a launch on a second stream) and ``ahead=True`` (a prediction between the step's kernels)
    give the default launch's routing, and leave every scratch's counters at zero between calls: interleaved,
    all three keep giving the reference."""
    from engine.kernels.fused import scratch

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 300, generator=g).to(DEVICE)
    router = torch.randn(256, 300, generator=g).to(DEVICE) * 300 ** -0.5 * 4
    ref_ids, ref_w = reference_logits_route(x, router, 8)
    for _ in range(2):
        side = kernels.route_triton(x, router, 8, side=True)
        ahead = kernels.route_triton(x, router, 8, ahead=True)
        main = kernels.route_triton(x, router, 8)
        for ids, w in (side, ahead, main):
            torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
            torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    for tag in ("", "side ", "ahead "):
        assert not scratch(tag + "router counters", (kernels.MAX_TOKENS,), torch.int32, torch.device(DEVICE)).any()
    with pytest.raises(ValueError, match="second stream"):
        kernels.route_triton(x, router, 8, side=True, ahead=True)


def test_route_from_x_reads_strided_rows_and_breaks_ties_to_the_lower_id():
    x = (torch.rand(3, 60) + 0.1).to(DEVICE)[:, :24]  # rows strided by 60
    router = torch.zeros(10, 24, device=DEVICE)
    router[[2, 5, 9]] = 1.0  # a three-way tie at the top: the sum of x, positive
    ids, w = kernels.route_triton(x, router, 2)
    assert ids.tolist() == [[2, 5]] * 3
    torch.testing.assert_close(w, torch.full((3, 2), 0.5, device=DEVICE))


def test_route_from_x_refuses_what_it_cannot_hold():
    x, router = torch.randn(2, 16, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        kernels.route_triton(x, router, 3)
    with pytest.raises(ValueError, match="k <= E"):
        kernels.route_triton(x, router[:4], 8)
    with pytest.raises(ValueError, match="k <= E <= 1024"):
        kernels.route_triton(x, torch.randn(1025, 16, device=DEVICE), 8)
    with pytest.raises(ValueError, match="T <= 16"):
        kernels.route_triton(torch.randn(17, 16, device=DEVICE), router, 2)
    with pytest.raises(ValueError, match=r"router \[E, H\]"):
        kernels.route_triton(x, router[:, :15], 2)
    with pytest.raises(ValueError, match="router float32"):
        kernels.route_triton(x, router.half(), 2)
    with pytest.raises(ValueError, match="x must be float32"):
        kernels.route_triton(x.double(), router, 2)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        kernels.route_triton(x.T, router, 2)


@pytest.mark.parametrize("T", [1, 3, 16])
def test_route_through_the_model_path_takes_the_same_experts(monkeypatch, T):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 200, generator=g).to(DEVICE, torch.bfloat16)
    router = torch.randn(60, 200, generator=g).to(DEVICE) * 0.3
    routes = []
    for flag in (False, True):
        monkeypatch.setattr(moe, "FUSED_GATE", flag)
        routes.append(moe.route(router, x, 4))
    (ref_ids, ref_w), (ids, w) = routes
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def _add_norm_route_case(T, E, H, dtype, device=DEVICE):
    g = torch.Generator().manual_seed(T * E + H)
    h, r = (torch.randn(T, H, generator=g).to(device, dtype) for _ in range(2))
    norm_weight = (1 + 0.2 * torch.randn(H, generator=g)).to(device)
    router = torch.randn(E, H, generator=g).to(device) * H ** -0.5 * 4
    return h, r, norm_weight, router


def _check_add_norm_route(out, h, r, norm_weight, router, k, dtype):
    """The sum as the add + norm kernel stores it, the norm within one rounding of its (the mean square
    is summed in another order), the routing of the stored norm bit for bit."""
    from engine.kernels.rms_norm import add_rms_norm_triton

    s, x, ids, w = out
    ref_s, ref_x = add_rms_norm_triton(h, r, norm_weight, 1e-6)
    assert s.dtype == x.dtype == dtype and torch.equal(s, ref_s)
    tol = dict(rtol=2 ** -7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.float(), ref_x.float(), **tol)
    r_ids, r_w = kernels.route_triton(x, router, k)
    assert torch.equal(ids, r_ids) and torch.equal(w, r_w)


@pytest.mark.parametrize("T, E, H, k", [(1, 60, 200, 2), (3, 256, 2048, 8), (16, 37, 100, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_route_matches_the_add_norm_then_the_router(T, E, H, k, dtype):
    h, r, norm_weight, router = _add_norm_route_case(T, E, H, dtype)
    out = kernels.add_norm_route_triton(h, r, norm_weight, 1e-6, router, k)
    _check_add_norm_route(out, h, r, norm_weight, router, k, dtype)
    again = kernels.add_norm_route_triton(h, r, norm_weight, 1e-6, router, k)  # the counters were left at zero
    assert all(torch.equal(a, b) for a, b in zip(again, out))
    with pytest.raises(ValueError, match="one \\[T, H\\] shape and dtype"):
        kernels.add_norm_route_triton(h, r[:, :-1], norm_weight, 1e-6, router, k)
    with pytest.raises(ValueError, match="norm's weight"):
        kernels.add_norm_route_triton(h, r, norm_weight[:-1], 1e-6, router, k)


@pytest.mark.parametrize("T", [1, 5])
def test_model_logits_with_the_norm_in_the_router(tiny_float32_model, fused_against_reference, monkeypatch, T):
    """The residual add + norm before the experts inside the router's launch (``NORM_IN_ROUTER``): the
    model's logits as with the norm's own launch, and the fused launch taken once a layer."""
    monkeypatch.setattr(moe, "FUSED_GATE", True)
    calls = []
    fused = kernels.add_norm_route_triton
    monkeypatch.setattr(kernels, "add_norm_route_triton", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    (ref, _), (out, _) = fused_against_reference(tiny_float32_model, moe, "NORM_IN_ROUTER", 20, T)
    assert len(calls) == tiny_float32_model.cfg.n_layers
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T, N", [(1, 7), (4, 512), (3, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_and_shared_combine(T, N, dtype):
    g = torch.Generator().manual_seed(T * N)
    gate, up, y, s = (torch.randn(T, N, generator=g).to(DEVICE, dtype) * 3 for _ in range(4))
    x = torch.randn(T, 97, generator=g).to(DEVICE, dtype)
    gate_inp = torch.randn(97, generator=g).to(DEVICE) * 0.3
    gl = x.float() @ gate_inp
    tol = dict(rtol=2 ** -7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    act = kernels.swiglu_triton(gate, up)
    assert act.dtype == dtype
    torch.testing.assert_close(act.float(), F.silu(gate.float()) * up.float(), **tol)
    out = kernels.shared_combine_triton(y, s, x, gate_inp, dtype)
    torch.testing.assert_close(out.float(), y.float() + torch.sigmoid(gl)[:, None] * s.float(), **tol)
    with pytest.raises(ValueError, match="one shape"):
        kernels.swiglu_triton(gate, up[:, :1])
    with pytest.raises(ValueError, match="gate_inp"):
        kernels.shared_combine_triton(y, s, x, gate_inp[:-1], dtype)


@pytest.mark.parametrize("T", [1, 5, 16])
def test_model_logits_with_the_fused_gate(tiny_float32_model, fused_against_reference, T):
    (ref, _), (out, _) = fused_against_reference(tiny_float32_model, moe, "FUSED_GATE", 20, T)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_shapes_on_cuda():
    """Qwen3.6-35B-A3B's shared expert FFN 512 (the router at these shapes: the graph test below)."""
    gate, up = (torch.randn(16, 512, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    torch.testing.assert_close(kernels.swiglu_triton(gate, up).float(), F.silu(gate.float()) * up.float(),
                               rtol=2 ** -7, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 16])
def test_route_from_x_at_real_shapes_replays_in_a_cuda_graph(T):
    """256 experts, top 8, hidden 2048, bf16 x: eager, then captured and replayed on new x."""
    router = torch.randn(256, 2048, device=DEVICE) * 0.02
    x = torch.randn(T, 2048, device=DEVICE, dtype=torch.bfloat16)
    ids, w = kernels.route_triton(x, router, 8)  # also the warm-up: compiles, makes the scratch
    ref_ids, ref_w = reference_logits_route(x, router, 8)
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, w = kernels.route_triton(x, router, 8)
    for _ in range(3):
        x.copy_(torch.randn(T, 2048, device=DEVICE, dtype=torch.bfloat16))
        graph.replay()
        ref_ids, ref_w = reference_logits_route(x, router, 8)
        torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 16])
def test_add_norm_route_at_real_shapes_replays_in_a_cuda_graph(T):
    """The residual add + norm in the router's launch at the 35B shapes (256 experts, top 8, hidden
    2048, bf16): eager, then captured and replayed on new rows."""
    h, r, norm_weight, router = _add_norm_route_case(T, 256, 2048, torch.bfloat16)
    out = kernels.add_norm_route_triton(h, r, norm_weight, 1e-6, router, 8)  # compiles, makes the scratch
    _check_add_norm_route(out, h, r, norm_weight, router, 8, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.add_norm_route_triton(h, r, norm_weight, 1e-6, router, 8)
    for _ in range(3):
        h.copy_(torch.randn_like(h))
        r.copy_(torch.randn_like(r))
        graph.replay()
        _check_add_norm_route(out, h, r, norm_weight, router, 8, torch.bfloat16)
