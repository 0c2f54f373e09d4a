from itertools import islice
from pathlib import Path

import pytest

from engine.gguf.reader import GGUFFile
from engine.gguf.writer import write_gguf
from engine.tokenizer import CONTROL, NORMAL, Tokenizer
from engine.train.bpe import SPECIAL_TOKENS, gguf_tokenizer_metadata, train_bpe
from engine.train.corpus import stdlib_sources, write_documents

VOCAB = Path(__file__).resolve().parents[4] / "shared" / "data" / "ggml-vocab-qwen35.gguf"
VOCAB_SIZE = 1024


@pytest.fixture(scope="module")
def texts() -> tuple[list[str], list[str]]:
    """60 library sources to train on and 3 others held out."""
    sources = [s.text for s in islice(stdlib_sources(), 63)]
    return sources[:60], sources[60:]


@pytest.fixture(scope="module")
def train_file(tmp_path_factory: pytest.TempPathFactory, texts) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "train.txt"
    write_documents(path, texts[0])
    return path


@pytest.fixture(scope="module")
def trained(train_file: Path):
    return train_bpe([train_file], VOCAB_SIZE, seed=0)


def test_vocabulary_has_specials_bytes_and_merges(trained):
    md = gguf_tokenizer_metadata(trained)
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == VOCAB_SIZE
    assert tuple(tokens[:3]) == SPECIAL_TOKENS and types[:3] == [CONTROL] * 3
    assert set(types[3:]) == {NORMAL}
    assert len(md["tokenizer.ggml.merges"]) == VOCAB_SIZE - 3 - 256
    assert all(len(m.split(" ")) == 2 for m in md["tokenizer.ggml.merges"])
    assert md["tokenizer.ggml.pre"] == "qwen35" and md["tokenizer.ggml.add_bos_token"] is False


def test_exported_tokenizer_encodes_like_the_trained_one(trained, texts, tmp_path: Path):
    path = write_gguf(tmp_path / "vocab.gguf",
                      {"general.architecture": "qwen35moe"} | gguf_tokenizer_metadata(trained), [])
    ours = Tokenizer.from_gguf(path)
    held_out = texts[1] + ["naïve 😀 ½\r\n\tx  <|im_start|>user\nHi<|im_end|>"]
    for text in held_out:
        ids = ours.encode(text)
        assert ids == trained.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids) == text
        assert max(ids) < VOCAB_SIZE
    assert ours.eos_ids == (0, 2)
    assert ours.apply_chat_template([{"role": "user", "content": "Hi"}]) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_key_types_match_the_llama_cpp_converter(trained, tmp_path: Path):
    path = write_gguf(tmp_path / "vocab.gguf",
                      {"general.architecture": "qwen35moe"} | gguf_tokenizer_metadata(trained), [])
    with GGUFFile(path) as ours, GGUFFile(VOCAB) as reference:
        ours_keys = {k for k in ours.metadata if k.startswith("tokenizer.")}
        shared = ours_keys & set(reference.metadata)
        assert shared == ours_keys - {"tokenizer.ggml.add_bos_token"}  # the reference has no add_bos_token
        assert {k: ours.metadata_types[k] for k in shared} == {k: reference.metadata_types[k] for k in shared}


def test_training_is_deterministic_and_seeded(train_file: Path, trained):
    again = train_bpe([train_file], VOCAB_SIZE, seed=0)
    assert gguf_tokenizer_metadata(again) == gguf_tokenizer_metadata(trained)
    a = gguf_tokenizer_metadata(train_bpe([train_file], 400, seed=1, max_bytes=60_000))
    b = gguf_tokenizer_metadata(train_bpe([train_file], 400, seed=2, max_bytes=60_000))
    assert a["tokenizer.ggml.merges"] != b["tokenizer.ggml.merges"]


def test_bad_arguments(train_file: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="vocab_size must exceed 259"):
        train_bpe([train_file], 259, seed=0)
    empty = tmp_path / "empty.txt"
    write_documents(empty, [])
    with pytest.raises(ValueError, match="hold no documents"):
        train_bpe([empty], 1000, seed=0)
