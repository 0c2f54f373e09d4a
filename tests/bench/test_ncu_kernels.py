"""bench/ncu_kernels.py: its shapes are the tile sweep's, and it refuses what it cannot run (the
launches need a GPU; ``bench/gpu/40_ncu_kernels.sh`` runs them under Nsight Compute)."""

import pytest
import torch


@pytest.fixture
def ncu_kernels(bench_script):
    return bench_script("ncu_kernels")


def test_refuses_unknown_shapes_and_a_cpu(ncu_kernels):
    with pytest.raises(SystemExit, match="gdn_inn not among"):
        ncu_kernels.main(["--shapes", "gdn_in,gdn_inn", "--device", "cuda"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            ncu_kernels.main(["--shapes", "gdn_in"])


def test_the_shared_expert_launch_matches_its_reference_at_small_shapes(ncu_kernels):
    """The experts' case as the script builds it, at a small hidden size on the CPU: the launches
    agree with the float32 reference the script checks them against."""
    import numpy as np

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    call, ref = ncu_kernels.launches("experts", "moe", 64, 96, dev, np.random.default_rng(0))
    assert ncu_kernels.rel_err(call(), ref) < 2e-2
    call, ref = ncu_kernels.launches("gdn_in", "gemv", 40, 96, dev, np.random.default_rng(1))
    assert ncu_kernels.rel_err(call(), ref) < 2e-2
