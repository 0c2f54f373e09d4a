"""The measured-tile table of the quantized decode kernels: written atomically, read only on the
GPU model it was measured on, ignored (with a warning) when unreadable; tiles from it reach the
GEMV and expert kernels and leave their results within the reference bounds."""

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are decorated

from engine.gguf.quants import random_quantized  # noqa: E402
from engine.kernels.quant import QuantExperts, QuantMatrix, qmatmul_experts_reference, qmatmul_reference  # noqa: E402
from engine.kernels.quant import tuned  # noqa: E402

triton_quant = pytest.importorskip("engine.kernels.quant.triton")
CPU = torch.device("cpu")


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setattr(tuned, "TABLE", path)
    tuned.load_table.cache_clear()
    yield path
    tuned.load_table.cache_clear()


def entry(kind="gemv", n=40, k=256, **tiles):
    return {"kind": kind, "qtype": "Q4_0", "n": n, "k": k, "gemv_block_n": 4, "gemv_block_k": 64,
            "gemv_num_warps": 2, "gemv_split_k": 2, "us": 1.0, **tiles}


def test_entries_apply_on_their_device_and_shape_only(table):
    default = triton_quant.QuantKernelConfig()
    assert tuned.config_for("gemv", "Q4_0", 40, 256, CPU, default) is default  # no file
    tuned.write_table(table, "cpu", [entry(), entry("experts", n=24)], {"date": "2026-12-01"})
    assert not table.with_suffix(".tmp").exists()
    got = tuned.config_for("gemv", "Q4_0", 40, 256, CPU, default)
    assert (got.gemv_block_n, got.gemv_block_k, got.gemv_num_warps, got.gemv_split_k) == (4, 64, 2, 2)
    assert got.block_m == default.block_m  # the GEMM tiles stay
    assert tuned.config_for("experts", "Q4_0", 24, 256, CPU, default).gemv_block_n == 4
    for other in [("gemv", "Q8_0", 40, 256), ("gemv", "Q4_0", 41, 256), ("experts", "Q4_0", 40, 256)]:
        assert tuned.config_for(*other, CPU, default) is default
    table.unlink()
    tuned.write_table(table, "NVIDIA H200", [entry()], {})
    assert tuned.config_for("gemv", "Q4_0", 40, 256, CPU, default) is default  # measured elsewhere


def test_a_gpu_of_the_tables_chip_reads_it_another_chip_does_not(table, monkeypatch):
    """An H100 SXM reads the H200's tiles (one die, 132 multiprocessors); a GPU of another chip keeps the defaults,
    and a table that names no chip applies to its own GPU's name only."""
    default = triton_quant.QuantKernelConfig()
    gpu = torch.device("cuda", 0)
    names = {"sm_90/132": "NVIDIA H100 80GB HBM3", "sm_90/114": "NVIDIA H100 PCIe"}
    chip = {"now": "sm_90/132"}
    monkeypatch.setattr(tuned, "chip_of", lambda device: chip["now"])
    monkeypatch.setattr(tuned, "_device_name", lambda device: names[chip["now"]])
    tuned.write_table(table, "NVIDIA H200", [entry()], {"chip": "sm_90/132"})
    got = tuned.config_for("gemv", "Q4_0", 40, 256, gpu, default)
    assert (got.gemv_block_n, got.gemv_split_k) == (4, 2)
    assert tuned.config_for("gemv", "Q4_0", 40, 512, gpu, default) is default  # not a measured shape
    chip["now"] = "sm_90/114"
    assert tuned.config_for("gemv", "Q4_0", 40, 256, gpu, default) is default
    chip["now"] = "sm_90/132"
    tuned.write_table(table, "NVIDIA H200", [entry()], {})  # no chip named: its own name only
    assert tuned.config_for("gemv", "Q4_0", 40, 256, gpu, default) is default


def test_the_shipped_table_names_its_chip():
    tables = tuned.read_tables(tuned.TABLE)
    assert [(t["device"], t["chip"]) for t in tables] == [("NVIDIA H200", "sm_90/132")]
    assert len(tables[0]["entries"]) >= 9


def test_writing_a_gpus_table_keeps_the_others_and_reads_the_first_format(table):
    """One file holds a table per GPU: writing one replaces that GPU's only; a file of one table at its top level
    (the first format) reads as that table and gains the new one beside it."""
    import json

    default = triton_quant.QuantKernelConfig()
    old = {"device": "cpu", "date": "2026-12-01", "entries": [entry()]}
    table.write_text(json.dumps(old))
    assert tuned.config_for("gemv", "Q4_0", 40, 256, CPU, default).gemv_split_k == 2
    tuned.write_table(table, "NVIDIA GeForce RTX 4090", [entry(n=24)], {"chip": "sm_89/128"})
    assert [t["device"] for t in tuned.read_tables(table)] == ["cpu", "NVIDIA GeForce RTX 4090"]
    assert tuned.config_for("gemv", "Q4_0", 40, 256, CPU, default).gemv_split_k == 2  # the cpu table stayed
    tuned.write_table(table, "cpu", [entry(n=24, gemv_split_k=4)], {})
    tables = tuned.read_tables(table)
    assert [t["device"] for t in tables] == ["NVIDIA GeForce RTX 4090", "cpu"]
    assert tuned.config_for("gemv", "Q4_0", 40, 256, CPU, default) is default  # replaced, not merged
    assert tuned.config_for("gemv", "Q4_0", 24, 256, CPU, default).gemv_split_k == 4


def test_a_file_that_is_not_a_table_is_not_overwritten(table):
    table.write_text('{"tables": [{"device": 3}]}')
    with pytest.raises(ValueError, match="not a tile table.*not overwritten"):
        tuned.write_table(table, "cpu", [entry()], {})
    assert table.read_text() == '{"tables": [{"device": 3}]}'
    with pytest.warns(UserWarning, match="not a tile table"):
        assert tuned.config_for("gemv", "Q4_0", 40, 256, CPU, triton_quant.QuantKernelConfig()).gemv_split_k != 2
