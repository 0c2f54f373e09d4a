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
    with pytest.warns(UserWarning, match="no decode tiles measured on NVIDIA H100 PCIe"):
        assert tuned.config_for("gemv", "Q4_0", 40, 256, gpu, default) is default
    chip["now"] = "sm_90/132"
    tuned.write_table(table, "NVIDIA H200", [entry()], {})  # no chip named: its own name only
    with pytest.warns(UserWarning, match="no decode tiles measured on NVIDIA H100 80GB HBM3"):
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


def test_a_gpu_without_a_table_is_told_once(table, monkeypatch):
    """A GPU with no table by name or chip hears once that its kernels keep the default tiles, and how to measure
    its own; a GPU whose table lacks only the shape (the shipped small models on the H200) hears nothing."""
    import warnings

    default = triton_quant.QuantKernelConfig()
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(tuned, "chip_of", lambda device: "sm_89/128")
    monkeypatch.setattr(tuned, "_device_name", lambda device: "NVIDIA GeForce RTX 4090")
    tuned.write_table(table, "NVIDIA H200", [entry()], {"chip": "sm_90/132"})
    with pytest.warns(UserWarning, match="no decode tiles measured on NVIDIA GeForce RTX 4090 .sm_89/128.*--sweep"):
        assert tuned.config_for("gemv", "Q4_0", 40, 256, gpu, default) is default
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned.config_for("gemv", "Q4_0", 24, 256, gpu, default) is default  # said once
    tuned.write_table(table, "NVIDIA GeForce RTX 4090", [entry()], {"chip": "sm_89/128"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned.config_for("gemv", "Q4_0", 40, 256, gpu, default).gemv_split_k == 2
        assert tuned.config_for("gemv", "Q4_0", 24, 256, gpu, default) is default  # its table lacks the shape only


def test_row_kernel_settings_come_from_the_table_when_an_entry_has_them(table):
    """An entry may name the row kernels (``gemv_rows_warps``, ``gemv_rows_unroll``); entries
    written before them keep the block kernels (``gemv_rows_warps`` 0)."""
    default = triton_quant.QuantKernelConfig()
    tuned.write_table(table, "cpu", [entry(gemv_rows_warps=4, gemv_rows_unroll=8), entry(n=24)], {})
    got = tuned.config_for("gemv", "Q4_0", 40, 256, CPU, default)
    assert (got.gemv_rows_warps, got.gemv_rows_unroll, got.gemv_split_k) == (4, 8, 2)
    assert tuned.config_for("gemv", "Q4_0", 24, 256, CPU, default).gemv_rows_warps == 0


def test_the_down_launch_split_per_pair_comes_from_the_table(table):
    """A ``moe_down`` entry may name ``gemv_pair_split``; entries written before it keep the program
    per token."""
    default = triton_quant.QuantKernelConfig()
    tuned.write_table(table, "cpu", [entry("moe_down", n=256, k=64, gemv_pair_split=1),
                                     entry("moe_down", n=128, k=64)], {})
    assert tuned.config_for("moe_down", "Q4_0", 256, 64, CPU, default).gemv_pair_split == 1
    assert tuned.config_for("moe_down", "Q4_0", 128, 64, CPU, default).gemv_pair_split == 0


def test_a_broken_table_warns_and_keeps_the_defaults(table):
    table.write_text("{not json")
    default = triton_quant.QuantKernelConfig()
    with pytest.warns(UserWarning, match="not a tile table"):
        assert tuned.config_for("gemv", "Q4_0", 40, 256, CPU, default) is default
    with pytest.raises(ValueError, match="lacks"):
        tuned.write_table(table, "cpu", [{"kind": "gemv", "qtype": "Q4_0", "n": 1, "k": 32}], {})
    with pytest.raises(ValueError, match="unknown kind"):
        tuned.write_table(table, "cpu", [entry(kind="gemm")], {})


def test_kernels_run_with_the_tiles_of_the_table(table, monkeypatch):
    """The kernels read the table when no tiles are given: the tuned tiles (a split K among them)
    are what they launch with, and the results match the references."""
    tuned.write_table(table, "cpu", [entry(n=40, k=256), entry("experts", n=24, k=256)], {})
    rng = np.random.default_rng(0)
    qm = QuantMatrix.from_gguf_bytes(random_quantized((40, 256), Q.Q4_0, rng, 0.02), Q.Q4_0, 40, 256)
    qe = QuantExperts.from_gguf_bytes(random_quantized((3, 24, 256), Q.Q4_0, rng, 0.02), Q.Q4_0, 3, 24, 256)
    seen = []
    real = triton_quant._split_k

    def spy(n_tiles, k, block_k, config, device):
        seen.append((n_tiles, block_k, config.gemv_split_k))
        return real(n_tiles, k, block_k, config, device)

    monkeypatch.setattr(triton_quant, "_split_k", spy)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(1))
    out = triton_quant.qmatmul(x, qm)
    assert seen == [(10, 64, 2)]  # 40 rows in tiles of 4, K tiles of 64, two splits
    assert ((out - qmatmul_reference(x, qm.raw, Q.Q4_0, 40, 256)).abs().max() < 1e-4)
    ids = torch.tensor([2, -1, 0])
    xs = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    got = triton_quant.qmatmul_experts(xs, qe, ids)
    assert (got - qmatmul_experts_reference(xs, qe.raw, ids, Q.Q4_0, 24, 256)).abs().max() < 1e-4
