"""The decode tile sweep's grid of bench/quant_matmul.py (timing needs a GPU; the grid does not)."""

import pytest


@pytest.fixture
def quant_matmul(bench_script):
    return bench_script("quant_matmul")


def test_sweep_tiles_reach_the_whole_of_k_and_stay_valid(quant_matmul):
    from engine.kernels.quant.triton import QuantKernelConfig

    qm = quant_matmul
    for tiles in qm.TILE_GRID + [qm.TILE_GRID[0] | v for v in qm.TILE_VARIANTS]:
        QuantKernelConfig(**tiles)  # every candidate passes the config's checks
    assert {v.get("gemv_num_warps") for v in qm.TILE_VARIANTS} >= {8, 16}
    assert all(t["gemv_block_n"] * t["gemv_block_k"] <= qm.MAX_TILE for t in qm.TILE_GRID)
    k_tiles = {k: {t["gemv_block_k"] for t in qm.tile_grid(k)} for k in (512, 2048, 4096)}
    assert k_tiles == {512: {128, 256, 512}, 2048: {128, 256, 512, 1024, 2048},
                       4096: {128, 256, 512, 1024, 2048, 4096}}
    assert max(len(qm.tile_grid(k)) for _, _, _, k in qm.decode_shapes()) <= 24
    assert {4, 8} <= {t["gemv_block_n"] for t in qm.tile_grid(4096) if t["gemv_block_k"] == 4096}


def test_the_down_launch_is_swept_per_token_and_per_pair(quant_matmul):
    from engine.kernels.quant.triton import QuantKernelConfig

    qm = quant_matmul
    down = qm.tile_grid(512, "moe_down")
    assert len(down) == 2 * len(qm.tile_grid(512))  # every tile both ways
    assert {t.get("gemv_pair_split", 0) for t in down} == {0, 1}
    assert all("gemv_pair_split" not in t for t in qm.tile_grid(512, "moe_gate_up"))
    for tiles in down:
        QuantKernelConfig(**tiles)
    assert "gemv_pair_split" in qm.FIELDS  # written to the table with the other fields


def test_the_word_gemv_is_swept_where_it_reads_the_weights(quant_matmul):
    """``--grid words``: tiles whose K tile divides K and holds a block for every lane, each a valid config
    that the word GEMV takes; the flag is written to the table."""
    from engine.kernels.quant import words
    from engine.kernels.quant.triton import QuantKernelConfig
    from gguf import GGMLQuantizationType as Q
    from types import SimpleNamespace

    qm = quant_matmul
    assert {t["gemv_block_k"] for t in qm.words_grid(2048)} == {1024, 2048}
    assert {t["gemv_block_k"] for t in qm.words_grid(4096)} == {1024, 2048, 4096}
    assert qm.words_grid(512) == []  # the shared expert's down projection: too short a K
    for k in (2048, 4096):
        for tiles in qm.words_grid(k):
            c = QuantKernelConfig(**tiles)
            rows = SimpleNamespace(stride=lambda _: k // 32 * 18)  # a split-layout row's bytes
            fake = SimpleNamespace(qtype=Q.Q4_0, layout="split", raw=rows, k=k)
            assert c.gemv_words == 1 and words.fits(fake, c.gemv_block_k, c.gemv_num_warps), tiles
    for tiles in qm.words_grid(512, "moe_down"):  # the experts' down: K in one tile, rows filling lane groups
        c = QuantKernelConfig(**tiles)
        rows = SimpleNamespace(stride=lambda _: 512 // 32 * 18)
        fake = SimpleNamespace(qtype=Q.Q4_0, layout="split", raw=rows, k=512)
        assert c.gemv_words == 1 and words.down_fits(fake, c.gemv_block_n, c.gemv_num_warps), tiles
    assert {t["gemv_block_n"] for t in qm.words_grid(512, "moe_down")} == {2, 4, 8, 16}
    assert qm.words_grid(96, "moe_down") == []
    assert "gemv_words" in qm.FIELDS
