"""Dequantizers against gguf-py's, quantizers' round-trip error bounds, random blocks."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from engine.gguf import quants

BLOCK_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
SCALE_BYTES = {Q.Q8_0: [slice(0, 2)], Q.Q4_0: [slice(0, 2)], Q.Q4_K: [slice(0, 2), slice(2, 4)],
               Q.Q5_K: [slice(0, 2), slice(2, 4)], Q.Q6_K: [slice(208, 210)]}
# Round-trip error bound per block, as a fraction of the block's max |x| (K types: per 256).
BOUNDS = {Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 7, Q.Q4_K: 1 / 14, Q.Q5_K: 1 / 30, Q.Q6_K: 1 / 60}


def gguf_dequant(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    if qtype == Q.F32:
        return data.view(np.float32).reshape(shape)
    if qtype == Q.F16:
        return gguf.quants.dequantize(data.view(np.float16), qtype).reshape(shape)
    rows = data.reshape(int(np.prod(shape[:-1])), -1)
    return gguf.quants.dequantize(rows, qtype).reshape(shape)


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform random bytes with every fp16 scale replaced by a finite one (sign random)."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for where in SCALE_BYTES[qtype]:
        scale = (rng.uniform(1e-4, 1e-1, n_blocks) * rng.choice([-1, 1], n_blocks)).astype(np.float16)
        blocks[:, where] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape_blocks", [(1, 1), (3, 7), (5, 3, 1)])
def test_block_dequantizer_equals_gguf(qtype, shape_blocks):
    rng = np.random.default_rng(1)
    block = GGML_QUANT_SIZES[qtype][0]
    shape = (*shape_blocks[:-1], shape_blocks[-1] * block)
    n_blocks = int(np.prod(shape)) // block
    raw = random_blocks(qtype, n_blocks, rng)
    ours = quants.dequantize(torch.from_numpy(raw), qtype, shape)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
    np.testing.assert_array_equal(ours.numpy(), gguf_dequant(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_float_dequantizer_equals_gguf(qtype):
    rng = np.random.default_rng(2)
    shape = (7, 13)
    raw = quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    ours = quants.dequantize(raw, qtype, shape)  # numpy input is accepted too
    np.testing.assert_array_equal(ours.numpy(), gguf_dequant(raw, qtype, shape))


def test_dequantize_reads_a_read_only_memory_view():
    raw = quants.quantize(np.arange(64, dtype=np.float32).reshape(2, 32), Q.Q8_0)
    raw.flags.writeable = False
    out = quants.dequantize(raw, Q.Q8_0, (2, 32))
    assert torch.allclose(out, torch.arange(64, dtype=torch.float32).reshape(2, 32), atol=0.5)


def edge_values() -> np.ndarray:
    """Random rows plus blocks that are zero, constant, all positive, all negative, one spike."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[0, :256] = 0
    x[1, :256] = 0.75
    x[2, :256] = np.abs(x[2, :256]) + 1
    x[3, :256] = -np.abs(x[3, :256]) - 1
    x[4, :256] = 0
    x[4, 17] = 40.0
    x[5] *= 1e-3
    return x


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_quantizer_round_trip_within_bound(qtype):
    x = edge_values()
    raw = quants.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.size == quants.tensor_nbytes(qtype, x.shape)
    back = gguf_dequant(raw, qtype, x.shape)
    block = GGML_QUANT_SIZES[qtype][0]
    err = np.abs(back - x).reshape(-1, block).max(axis=1)
    scale = np.abs(x).reshape(-1, block).max(axis=1)
    worst = np.max(err / np.maximum(scale, 1e-30))
    assert worst <= BOUNDS[qtype], f"{qtype.name}: error {worst:.4f} of block max > {BOUNDS[qtype]:.4f}"
    assert np.all(back.reshape(-1, 512)[0, :256] == 0), "a zero block must come back exactly"
    # and our dequantizer reads our encoding the same way gguf-py does
    np.testing.assert_array_equal(quants.dequantize(raw, qtype, x.shape).numpy(), back)


@pytest.mark.parametrize("qtype,rel", [(Q.F32, 0.0), (Q.F16, 2.0 ** -11), (Q.BF16, 2.0 ** -8)],
                         ids=["F32", "F16", "BF16"])
def test_float_quantizer_relative_error(qtype, rel):
    x = edge_values()
    back = gguf_dequant(quants.quantize(x, qtype), qtype, x.shape)
    subnormal = 2.0 ** -25 if qtype == Q.F16 else 0.0  # half of fp16's smallest step
    assert np.all(np.abs(back - x) <= rel * np.abs(x) + subnormal)


def test_k_quant_error_is_near_half_a_step_on_average():
    """A loose encoder could meet the worst-case bound yet be biased: check the mean error."""
    x = np.random.default_rng(4).standard_normal((8, 256 * 4)).astype(np.float32)
    for qtype, levels in ((Q.Q4_K, 15), (Q.Q5_K, 31)):
        back = gguf_dequant(quants.quantize(x, qtype), qtype, x.shape)
        xs = x.reshape(-1, 32)
        step = (xs.max(axis=1) - np.minimum(xs.min(axis=1), 0)) / levels
        mean_err = np.abs(back - x).reshape(-1, 32).mean(axis=1)
        assert np.mean(mean_err / step) < 0.35, qtype.name  # uniform rounding gives 0.25


def test_quantize_rejects_rows_not_a_multiple_of_the_block():
    with pytest.raises(ValueError, match="row length 100 is not a multiple of the Q4_K block size 256"):
        quants.quantize(np.zeros((2, 100), np.float32), Q.Q4_K)


def test_unsupported_type_is_refused():
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        quants.tensor_nbytes(Q.IQ2_XXS, (256,))


def test_dequantize_checks_the_byte_count():
    with pytest.raises(ValueError, match="needs 68 bytes, got 34"):
        quants.dequantize(np.zeros(34, np.uint8), Q.Q8_0, (2, 32))


def test_tensor_nbytes():
    assert quants.tensor_nbytes(Q.F32, (3, 5)) == 60
    assert quants.tensor_nbytes(Q.BF16, (3, 5)) == 30
    assert quants.tensor_nbytes(Q.Q8_0, (4, 64)) == 4 * 2 * 34
    assert quants.tensor_nbytes(Q.Q4_K, (8, 2, 512)) == 32 * 144
    assert quants.tensor_nbytes(Q.Q6_K, (256,)) == 210


@pytest.mark.parametrize("qtype", quants.SUPPORTED, ids=lambda q: q.name)
def test_random_quantized_is_valid_with_the_requested_std(qtype):
    shape = (16, 1024)
    raw = quants.random_quantized(shape, qtype, np.random.default_rng(5), 0.02)
    assert raw.dtype == np.uint8 and raw.size == quants.tensor_nbytes(qtype, shape)
    values = gguf_dequant(raw, qtype, shape)
    assert np.all(np.isfinite(values))
    assert abs(values.std() / 0.02 - 1) < 0.1
    assert abs(values.mean()) < 0.15 * 0.02
    again = quants.random_quantized(shape, qtype, np.random.default_rng(5), 0.02)
    np.testing.assert_array_equal(raw, again)
