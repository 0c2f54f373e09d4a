"""write_gguf: byte compatibility with gguf-py, key types, round trips, atomicity."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFValue, GGUFValueType as V

from engine.gguf import quants
from engine.gguf.reader import GGUFFile
from engine.gguf.writer import TensorSpec, encode_kv, write_gguf

ARCH = "qwen35moe"


def test_bytes_equal_gguf_writer_helpers(tmp_path):
    """Same keys through GGUFWriter's add_* helpers and through write_gguf: identical files."""
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 64)).astype(np.float32)
    q8 = quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), Q.Q8_0)
    q4k = quants.quantize(rng.standard_normal((1, 256)).astype(np.float32), Q.Q4_K)

    ref = tmp_path / "ref.gguf"
    w = gguf.GGUFWriter(ref, ARCH)
    w.add_block_count(5)
    w.add_context_length(262144)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e7)
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_expert_count(256)
    w.add_ssm_conv_kernel(4)
    w.add_nextn_predict_layers(1)
    w.add_full_attention_interval(4)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_types([1, 1, 3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_tensor("w.f32", f32)
    w.add_tensor("w.q8", q8.reshape(2, -1), raw_dtype=Q.Q8_0)
    w.add_tensor("w.q4k", q4k.reshape(1, -1), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours = write_gguf(tmp_path / "ours.gguf", {
        "general.architecture": ARCH,
        f"{ARCH}.block_count": 5,
        f"{ARCH}.context_length": 262144,
        f"{ARCH}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{ARCH}.rope.freq_base": 1e7,
        f"{ARCH}.rope.dimension_sections": [11, 11, 10, 0],
        f"{ARCH}.expert_count": 256,
        f"{ARCH}.ssm.conv_kernel": 4,
        f"{ARCH}.nextn_predict_layers": 1,
        f"{ARCH}.full_attention_interval": 4,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.token_type": [1, 1, 3],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }, [TensorSpec("w.f32", (3, 64), Q.F32, lambda: f32),
        TensorSpec("w.q8", (2, 64), Q.Q8_0, lambda: q8),
        ("w.q4k", (1, 256), Q.Q4_K, lambda: q4k)])
    assert ours.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize("qtype", quants.SUPPORTED, ids=lambda q: q.name)
def test_round_trip_of_every_type(tmp_path, qtype):
    rng = np.random.default_rng(1)
    shapes = {"vec": (256,), "mat": (3, 512), "exps": (2, 3, 256)}
    values = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    raw_given = quants.random_quantized((4, 256), qtype, rng, 0.1)
    specs = [TensorSpec(k, s, qtype, (lambda k=k: values[k])) for k, s in shapes.items()]
    specs.append(TensorSpec("raw", (4, 256), qtype, lambda: raw_given))
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": ARCH}, specs)
    with GGUFFile(path) as f:
        assert f.alignment == 32 and f.data_offset % 32 == 0
        for k, s in shapes.items():
            info = f.tensors[k]
            assert (info.shape, info.qtype, info.offset % 32) == (s, qtype, 0)
            expect = quants.dequantize(quants.quantize(values[k], qtype), qtype, s)
            assert np.array_equal(f.load(k).numpy(), expect.numpy())
        np.testing.assert_array_equal(f.raw("raw"), raw_given)


def test_standard_keys_get_llama_cpp_types(tmp_path):
    md = {
        "general.architecture": ARCH,
        "general.file_type": 15,
        f"{ARCH}.block_count": 41,
        f"{ARCH}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{ARCH}.rope.freq_base": 10000000.0,
        f"{ARCH}.rope.dimension_sections": (11, 11, 10, 0),
        "tokenizer.ggml.tokens": ["x", "y"],
        "tokenizer.ggml.token_type": [1, 3],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.add_bos_token": False,
        "custom.count": 7,
        "custom.offset": -3,
        "custom.ratio": 0.5,
        "custom.forced": GGUFValue(7, V.UINT64),
        "custom.table": np.array([1.5, 2.5], dtype=np.float64),
    }
    path = write_gguf(tmp_path / "kv.gguf", md, [])
    with GGUFFile(path) as f:
        types = f.metadata_types
        assert types[f"{ARCH}.block_count"] == (V.UINT32, None)
        assert types["general.file_type"] == (V.UINT32, None)
        assert types[f"{ARCH}.attention.layer_norm_rms_epsilon"] == (V.FLOAT32, None)
        assert types[f"{ARCH}.rope.freq_base"] == (V.FLOAT32, None)
        assert types[f"{ARCH}.rope.dimension_sections"] == (V.ARRAY, V.INT32)
        assert types["tokenizer.ggml.tokens"] == (V.ARRAY, V.STRING)
        assert types["tokenizer.ggml.token_type"] == (V.ARRAY, V.INT32)
        assert types["tokenizer.ggml.bos_token_id"] == (V.UINT32, None)
        assert types["tokenizer.ggml.add_bos_token"] == (V.BOOL, None)
        assert types["custom.count"] == (V.UINT32, None)
        assert types["custom.offset"] == (V.INT32, None)
        assert types["custom.ratio"] == (V.FLOAT32, None)
        assert types["custom.forced"] == (V.UINT64, None)
        assert types["custom.table"] == (V.ARRAY, V.FLOAT64)
        assert f.metadata[f"{ARCH}.attention.layer_norm_rms_epsilon"] == 1e-6
        assert f.metadata[f"{ARCH}.rope.dimension_sections"] == [11, 11, 10, 0]
        assert f.metadata["tokenizer.ggml.add_bos_token"] is False
        assert f.metadata["custom.table"] == [1.5, 2.5]
        assert f.tensors == {}


def test_a_value_that_does_not_fit_its_type_names_the_key():
    with pytest.raises(ValueError, match="metadata key 'qwen35moe.block_count': value -1 cannot be written as UINT32"):
        encode_kv(f"{ARCH}.block_count", -1)


def test_failing_producer_leaves_no_file(tmp_path):
    def boom():
        raise RuntimeError("disk producer failed")

    target = tmp_path / "m.gguf"
    specs = [TensorSpec("a", (32,), Q.F32, lambda: np.zeros(32, np.float32)), TensorSpec("b", (32,), Q.F32, boom)]
    with pytest.raises(RuntimeError, match="disk producer failed"):
        write_gguf(target, {"general.architecture": ARCH}, specs)
    assert list(tmp_path.iterdir()) == []


def test_failed_rewrite_keeps_the_old_file(tmp_path):
    target = write_gguf(tmp_path / "m.gguf", {"general.architecture": ARCH},
                        [TensorSpec("a", (32,), Q.F32, lambda: np.ones(32, np.float32))])
    before = target.read_bytes()
    with pytest.raises(ValueError, match="tensor 'a': producer returned 16 values, expected 32"):
        write_gguf(target, {"general.architecture": ARCH},
                   [TensorSpec("a", (32,), Q.F32, lambda: np.ones(16, np.float32))])
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_wrong_byte_count_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tensor 'q': producer returned 10 bytes, expected 34"):
        write_gguf(tmp_path / "m.gguf", {"general.architecture": ARCH},
                   [TensorSpec("q", (32,), Q.Q8_0, lambda: np.zeros(10, np.uint8))])
    assert list(tmp_path.iterdir()) == []


def test_spec_validation():
    with pytest.raises(ValueError, match="tensor 'x': row length 100 is not a multiple of the Q8_0 block size 32"):
        TensorSpec("x", (2, 100), Q.Q8_0, lambda: None)
    with pytest.raises(ValueError, match="given twice"):
        write_gguf("unused.gguf", {"general.architecture": ARCH},
                   [TensorSpec("x", (32,), Q.F32, lambda: None)] * 2)


def test_progress_reports_bytes(tmp_path):
    seen = []
    specs = [TensorSpec(f"t{i}", (64,), Q.F32, lambda: np.zeros(64, np.float32)) for i in range(3)]
    write_gguf(tmp_path / "m.gguf", {"general.architecture": ARCH}, specs,
               progress=lambda done, total: seen.append((done, total)))
    assert seen == [(256, 768), (512, 768), (768, 768)]


def test_producers_run_one_at_a_time(tmp_path):
    """Each tensor's data is produced only when its turn comes, after the previous one is written."""
    order = []
    target = tmp_path / "m.gguf"

    def producer(i):
        def make():
            order.append((i, target.exists()))
            return np.full(32, i, np.float32)
        return make

    write_gguf(target, {"general.architecture": ARCH}, [TensorSpec(f"t{i}", (32,), Q.F32, producer(i)) for i in range(3)])
    assert order == [(0, False), (1, False), (2, False)]
