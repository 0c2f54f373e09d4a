"""GGUFFile: validation errors within a second, agreement with gguf-py, tensor loads."""

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.errors import ConfigError, GGUFError
from engine.gguf import quants, reader
from engine.gguf.make_model import default_vocab_path
from engine.gguf.reader import GGUFFile, TensorInfo
from engine.gguf.writer import TensorSpec, write_gguf
from engine.model.config import ModelConfig

ARCH = "qwen35moe"


def _find_vocab() -> Path | None:
    try:
        return default_vocab_path()
    except ConfigError:
        return None


VOCAB = _find_vocab()


def small_file(path: Path) -> Path:
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((64, 32)).astype(np.float32)
    return write_gguf(path, {
        "general.architecture": ARCH,
        "tokenizer.ggml.tokens": [f"tok{i}" for i in range(300)],
        f"{ARCH}.block_count": 4,
    }, [TensorSpec("blk.3.attn_qkv.weight", (64, 32), Q.F32, lambda: qkv),
        TensorSpec("blk.3.ffn_down_exps.weight", (4, 8, 256), Q.Q4_K,
                   lambda: rng.standard_normal((4, 8, 256)).astype(np.float32)),
        TensorSpec("output_norm.weight", (32,), Q.F32, lambda: np.ones(32, np.float32))])


def expect_error(path, match, **kw):
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match=match) as exc:
        GGUFFile(path, **kw)
    assert time.perf_counter() - t0 < 1.0
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", r"nope.gguf: file not found")


def test_file_shorter_than_a_header(tmp_path):
    p = tmp_path / "short.gguf"
    p.write_bytes(b"GGUF\x03\x00")
    expect_error(p, r"short.gguf: file is 6 bytes, shorter than a GGUF header \(24 bytes\)")


def test_wrong_magic_says_what_was_found(tmp_path):
    p = tmp_path / "model.bin"
    p.write_bytes(b"GGML" + bytes(60))
    expect_error(p, r"model.bin: not a GGUF file \(magic bytes b'GGML', expected b'GGUF'\)")


def test_unsupported_version(tmp_path):
    p = tmp_path / "v9.gguf"
    p.write_bytes(struct.pack("<4sIQQ", b"GGUF", 9, 0, 0))
    expect_error(p, r"v9.gguf: GGUF version 9 is not supported \(supported: 2, 3\)")
    p.write_bytes(struct.pack(">4sIQQ", b"GGUF", 3, 0, 0))
    expect_error(p, r"v9.gguf: file is a big-endian GGUF, which is not supported")


def test_truncated_tensor_data(tmp_path):
    p = small_file(tmp_path / "m.gguf")
    p.write_bytes(p.read_bytes()[:-200])
    expect_error(p, r"m.gguf: tensor '[\w.]+' data ends at byte \d+, beyond the end of the "
                    r"file \(\d+ bytes\): the file is truncated")


def test_metadata_cut_short(tmp_path):
    p = small_file(tmp_path / "m.gguf")
    p.write_bytes(p.read_bytes()[:1000])  # inside the token list
    expect_error(p, r"m.gguf: file is cut short in metadata key 'tokenizer.ggml.tokens' at byte \d+ "
                    r"\(file is 1000 bytes\)")


def test_string_arrays_with_empty_nul_and_multibyte_entries(tmp_path):
    for words in (["", "a", "é€😀", "", "z"], ["nul\0inside", "", "x"], [""]):
        p = write_gguf(tmp_path / "s.gguf", {"general.architecture": ARCH, "words": words}, [])
        with GGUFFile(p) as f:
            assert f.metadata["words"] == words


def test_tensor_of_unsupported_quant_type(tmp_path):
    p = tmp_path / "q5.gguf"
    w = gguf.GGUFWriter(p, ARCH)
    w.add_tensor("blk.0.attn_k.weight", np.zeros((2, 22), np.uint8), raw_dtype=Q.Q5_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect_error(p, r"q5.gguf: tensor 'blk.0.attn_k.weight' has quant type Q5_0, which is not supported "
                    r"\(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K\)")


def test_other_architecture(tmp_path):
    p = write_gguf(tmp_path / "llama.gguf", {"general.architecture": "llama"}, [])
    expect_error(p, r"llama.gguf: architecture is 'llama', expected 'qwen35moe'", architecture=ARCH)
    with GGUFFile(p) as f:
        with pytest.raises(GGUFError, match=r"llama.gguf: architecture is 'llama', expected 'qwen35moe'"):
            ModelConfig.from_metadata(f.metadata, source=str(p))


def test_check_tensors_names_the_first_problem(tmp_path):
    p = small_file(tmp_path / "m.gguf")
    with GGUFFile(p) as f:
        f.check_tensors({"blk.3.attn_qkv.weight": (64, 32), "output_norm.weight": (32,)})
        t0 = time.perf_counter()
        with pytest.raises(GGUFError) as exc:
            f.check_tensors({"output_norm.weight": (32,), "blk.3.attn_qkv.weight": (128, 32),
                             "blk.9.attn_qkv.weight": (1, 1)})
        assert str(exc.value) == f"{p}: tensor 'blk.3.attn_qkv.weight' has shape (64, 32), expected (128, 32)"
        with pytest.raises(GGUFError) as exc:
            f.check_tensors({"token_embd.weight": (300, 32)}, source="target model")
        assert str(exc.value) == "target model: tensor 'token_embd.weight' is missing (expected shape (300, 32))"
        assert time.perf_counter() - t0 < 1.0


def test_agrees_with_gguf_reader(tmp_path):
    p = small_file(tmp_path / "m.gguf")
    ref = gguf.GGUFReader(p)
    with GGUFFile(p) as f:
        assert f.architecture == ARCH and f.version == 3
        for key, field in ref.fields.items():
            if not key.startswith("GGUF."):
                assert f.metadata[key] == field.contents(), key
        assert [t.name for t in ref.tensors] == list(f.tensors)
        for t in ref.tensors:
            info = f.tensors[t.name]
            assert info == TensorInfo(t.name, tuple(reversed(t.shape.tolist())), t.tensor_type, t.n_bytes,
                                      t.data_offset)
            np.testing.assert_array_equal(f.raw(t.name), t.data.reshape(-1).view(np.uint8))
            ref_values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
            np.testing.assert_array_equal(f.load(t.name).numpy(), ref_values)


def test_load_dtype_device_and_chunks(tmp_path, monkeypatch):
    p = small_file(tmp_path / "m.gguf")
    with GGUFFile(p) as f:
        name = "blk.3.ffn_down_exps.weight"
        full = f.load(name)
        assert full.shape == (4, 8, 256) and full.dtype == torch.float32
        monkeypatch.setattr(reader, "_CPU_CHUNK_BYTES", 300)  # two rows of 144 bytes per slab
        assert torch.equal(f.load(name), full)
        bf16 = f.load(name, dtype=torch.bfloat16, device=torch.device("cpu"))
        assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, full.to(torch.bfloat16))
        qkv = f.load("blk.3.attn_qkv.weight")
        qkv.add_(1)  # a loaded tensor owns its memory: the file and later loads are unaffected
        assert torch.equal(f.load("blk.3.attn_qkv.weight") + 1, qkv)
        raw = f.raw(name)
        assert raw.dtype == np.uint8 and raw.size == quants.tensor_nbytes(Q.Q4_K, (4, 8, 256))
        assert not raw.flags.writeable
        with pytest.raises(GGUFError, match=r"m.gguf: tensor 'nope' is not in the file"):
            f.load("nope")
    with pytest.raises(GGUFError, match="file is closed"):
        f.load(name)


def test_raw_view_outlives_close(tmp_path):
    p = small_file(tmp_path / "m.gguf")
    f = GGUFFile(p)
    raw = f.raw("output_norm.weight")
    f.close()
    assert raw.view(np.float32).tolist() == [1.0] * 32


@pytest.mark.skipif(VOCAB is None, reason="shared/data vocabulary GGUF not present")
def test_vocab_only_file_opens_fast():
    t0 = time.perf_counter()
    with GGUFFile(VOCAB) as f:
        elapsed = time.perf_counter() - t0
        assert f.architecture == "qwen2" and f.tensors == {}
        tokens = f.metadata["tokenizer.ggml.tokens"]
        assert len(tokens) == 151936 and tokens[:3] == ["!", '"', "#"] and tokens[151643] == "<|endoftext|>"
        assert len(f.metadata["tokenizer.ggml.merges"]) == 151387
        assert f.metadata["tokenizer.ggml.token_type"][151644] == 3
        assert f.metadata["tokenizer.ggml.pre"] == "qwen35"
    assert elapsed < 1.0
