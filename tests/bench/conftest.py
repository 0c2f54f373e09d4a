"""The scripts under bench/ imported as modules: they import their siblings (``common``, ``quant_matmul``)
by name, so the folder goes on the path for the test; Triton kernels run through the interpreter
where there is no GPU (read when the kernels are decorated, as the kernel tests set it)."""

import importlib
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_script(monkeypatch):
    """``bench_script("name")``: the module of ``bench/name.py``."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module
