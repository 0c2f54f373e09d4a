"""Fixtures shared by the engine's tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread: the models and kernels under test are tiny, so a second thread
    only adds synchronisation, which costs a lot on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
