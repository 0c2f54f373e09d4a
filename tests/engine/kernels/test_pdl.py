"""When the decode kernels are launched with programmatic dependent launch (``engine.kernels.pdl``).
That the kernels then wait before touching their inputs is checked in their machine code
(``test_rows_compile.py``); their results with PDL on are the CUDA tests' (docs/benchmarks.md)."""

import pytest
import torch

pytest.importorskip("triton")
from engine.kernels import pdl  # noqa: E402


@pytest.fixture
def restore():
    saved = pdl.ENABLED
    yield
    pdl.ENABLED = saved


def test_the_kernel_flag_and_the_launch_attribute_always_go_together(restore):
    cuda = torch.device("cuda", 0)  # not touched while ENABLED is set
    for setting, device, on in ((None, torch.device("cpu"), False), (True, cuda, True), (False, cuda, False)):
        pdl.ENABLED = setting
        assert pdl.launch(device) == {"PDL": on, "launch_pdl": on}


def test_never_on_the_cpu_and_switched_off_by_the_environment(restore, monkeypatch):
    pdl.ENABLED = None
    assert not pdl.enabled(torch.device("cpu"))
    pdl.ENABLED = True
    assert not pdl.enabled(torch.device("cpu")) and pdl.enabled(torch.device("cuda", 0))
    pdl.ENABLED = None
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.enabled(torch.device("cuda", 0))  # decided before asking the device
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_by_default_from_hopper(restore, monkeypatch):
    pdl.ENABLED = None
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device = torch.device("cuda", 0)
    assert pdl.enabled(device) == (torch.cuda.get_device_capability(device) >= (9, 0))


def test_only_for_decode_sized_launches_and_not_for_skipped_families(restore, monkeypatch):
    cuda = torch.device("cuda", 0)
    pdl.ENABLED = True
    assert pdl.enabled(cuda, pdl.MAX_TOKENS, "gemv") and not pdl.enabled(cuda, pdl.MAX_TOKENS + 1, "gemv")
    monkeypatch.setenv(pdl.SKIP_ENV, "experts,router")
    assert not pdl.enabled(cuda, 1, "experts") and not pdl.enabled(cuda, 1, "router")
    assert pdl.enabled(cuda, 1, "norm") and pdl.launch(cuda, 1, "router") == {"PDL": False, "launch_pdl": False}
    with pytest.raises(ValueError, match="unknown kernel family"):
        pdl.enabled(cuda, 1, "moe")
