"""bench/small_kernels.py's cases at the 35B decode shapes, run once each through the Triton
interpreter (timing needs a GPU; the shapes and calls do not), and the warps table's checks."""

import pytest
import torch


@pytest.fixture
def small_kernels(bench_script):
    return bench_script("small_kernels")


@pytest.mark.parametrize("name", ["router", "norm", "gated_norm", "rope", "gdn_prologue", "delta_rule",
                                  "attention_chunk"])
def test_every_case_runs_at_the_35b_shapes(small_kernels, name):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    depth = 64
    listed = small_kernels.cases(name, 1, depth, dev, g)
    assert listed and all(per_step in (0, 10, 30, 40, 80) for _, per_step, _ in listed)
    for label, _, call in listed:
        outs = small_kernels.as_list(call())
        assert outs and all(torch.isfinite(o).all() for o in outs), label
        again = small_kernels.as_list(call())  # the same inputs every call (the prologue restores its state)
        assert all(torch.equal(a, b) for a, b in zip(outs, again)), label


def test_the_warps_table_refuses_unknown_kernels_and_counts(small_kernels):
    from engine.kernels import warps

    assert set(warps.WARPS) >= {"router", "norm", "gated_norm", "rope", "gdn_prologue", "delta_rule"}
    before = dict(warps.WARPS)
    with pytest.raises(ValueError, match="is not one of"):
        warps.set_warps("norms", 2)
    with pytest.raises(ValueError, match="is not one of"):
        warps.set_warps("norm", 3)
    assert warps.WARPS == before
    with pytest.raises(SystemExit, match="nope not among"):
        small_kernels.main(["--kernels", "router,nope", "--device", "cpu"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        small_kernels.main(["--kernels", "router", "--device", "cpu"])
