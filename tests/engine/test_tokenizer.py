from pathlib import Path

import pytest
from gguf import GGUFWriter

from engine.errors import EngineError
from engine.tokenizer import (CONTROL, NORMAL, USER_DEFINED, Tokenizer, byte_to_unicode,
                              pre_tokenize)

VOCAB = Path(__file__).resolve().parents[3] / "shared" / "data" / "ggml-vocab-qwen35.gguf"
SEPARATOR = "\n__ggml_vocab_test__\n"


def read_vectors(vocab: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 format: inputs split on the separator, one id line per input."""
    raw = vocab.with_name(vocab.name + ".inp").read_bytes().decode("utf-8")
    inputs = raw.split(SEPARATOR)
    if inputs[-1] == "":  # the file ends with a separator: no input after it
        inputs.pop()
    lines = vocab.with_name(vocab.name + ".out").read_bytes().decode("utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines)
    return [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, lines)]


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return Tokenizer.from_gguf(VOCAB)


@pytest.fixture(scope="module")
def qwen_metadata(qwen: Tokenizer) -> dict:
    s = qwen.spec
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": s.pre,
        "tokenizer.ggml.tokens": list(s.tokens), "tokenizer.ggml.token_type": list(s.token_types),
        "tokenizer.ggml.merges": list(s.merges), "tokenizer.ggml.bos_token_id": s.bos_id,
        "tokenizer.ggml.eos_token_id": s.eos_id, "tokenizer.ggml.padding_token_id": s.pad_id,
    }


def test_llama_cpp_vectors_all_match(qwen: Tokenizer):
    vectors = read_vectors(VOCAB)
    assert len(vectors) == 50
    failures = [(text, ids, qwen.encode(text)) for text, ids in vectors if qwen.encode(text) != ids]
    assert failures == []
    # llama.cpp's test tokenizes without parsing specials; none of the inputs holds one
    assert all(qwen.encode(text, parse_special=False) == ids for text, ids in vectors)
    assert all(qwen.decode(ids) == text for text, ids in vectors)


def test_vocab_only_file_loads_with_its_special_tokens(qwen: Tokenizer):
    assert qwen.vocab_size == 151936
    assert qwen.spec.pre == "qwen35"
    assert qwen.bos_id == qwen.eos_id == qwen.pad_id == 151643
    assert qwen.eos_ids == (151643, 151645)  # <|endoftext|> and <|im_end|>
    assert qwen.token_type(151644) == CONTROL
    assert qwen.token_type(151700) == USER_DEFINED
    assert qwen.token_type(9707) == NORMAL


def test_build_from_metadata(qwen_metadata: dict):
    tok = Tokenizer.from_metadata(qwen_metadata, "qwen35 vocab")
    assert tok.encode("Hello world") == [9707, 1879]


def test_control_tokens_are_parsed_only_when_asked(qwen: Tokenizer):
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = qwen.encode(text)
    assert ids[0] == 151644 and ids[-1] == 151645 and len(ids) == 5
    plain = qwen.encode(text, parse_special=False)
    assert 151644 not in plain and 151645 not in plain
    assert qwen.decode(plain) == text
    assert qwen.decode(ids) == text
    assert qwen.decode(ids, skip_special=True) == "user\nHi"
    # user-defined tokens are matched either way, as llama.cpp does
    assert qwen.encode("[PAD151700]", parse_special=False) == [151700]


def test_decode_of_a_split_character_replaces_it(qwen: Tokenizer):
    ids = qwen.encode("𓀀")
    assert len(ids) > 1
    assert qwen.decode(ids[:1]) == "\ufffd"
    assert qwen.decode_bytes(ids) == "𓀀".encode()


def test_decode_rejects_ids_outside_the_vocabulary(qwen: Tokenizer):
    with pytest.raises(EngineError, match="token id 151936 is outside"):
        qwen.decode([151936])


def test_add_special_follows_add_bos_token(qwen_metadata: dict):
    assert Tokenizer.from_metadata(qwen_metadata, "m").encode("Hi", add_special=True) == [13048]
    with_bos = Tokenizer.from_metadata(qwen_metadata | {"tokenizer.ggml.add_bos_token": True}, "m")
    assert with_bos.encode("Hi", add_special=True) == [151643, 13048]
    assert with_bos.encode("Hi") == [13048]
    assert with_bos.encode_batch(["Hi", "Hi"], add_special=True) == [[151643, 13048]] * 2


def test_chat_template(qwen: Tokenizer):
    text = qwen.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert qwen.encode(text).count(151644) == 3


def test_template_errors_are_engine_errors(qwen_metadata: dict):
    md = qwen_metadata | {"tokenizer.chat_template": "{{ raise_exception('no system role') }}"}
    with pytest.raises(EngineError, match="no system role"):
        Tokenizer.from_metadata(md, "m").apply_chat_template([])
    with pytest.raises(EngineError, match="chat_template is missing"):
        Tokenizer.from_metadata(qwen_metadata, "m").apply_chat_template([])


def test_pre_tokenizers_differ_where_llama_cpp_says():
    text = "He's 12345 cafe\u0301!"
    assert pre_tokenize("qwen35", text) == ["He", "'s", " ", "1", "2", "3", "4", "5", " cafe\u0301", "!"]
    assert pre_tokenize("qwen2", text)[-2:] == [" cafe", "\u0301!"]
    assert pre_tokenize("llama-bpe", text)[2:5] == [" ", "123", "45"]
    assert pre_tokenize("gpt-2", text)[2] == " 12345"


def byte_vocab_metadata(**extra) -> dict:
    alphabet = list(byte_to_unicode().values())
    tokens = alphabet + ["ab", "<|end|>"]
    md = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [NORMAL] * 257 + [CONTROL], "tokenizer.ggml.merges": ["a b"],
    }
    return md | extra


def test_small_vocab_merges_and_falls_back_to_bytes():
    tok = Tokenizer.from_metadata(byte_vocab_metadata(), "small")
    a, b = tok.encode("a"), tok.encode("b")
    assert tok.encode("ab") == [256] and tok.encode("ba") == b + a
    assert tok.decode(tok.encode("zé\n")) == "zé\n"
    assert tok.eos_ids == (257,)


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model is 'llama'"),
    ({"tokenizer.ggml.pre": "nonexistent"}, "tokenizer.ggml.pre is 'nonexistent'"),
    ({"tokenizer.ggml.token_type": [NORMAL] * 3}, "token_type has 3 entries, expected 258"),
    ({"tokenizer.ggml.merges": ["ab"]}, "merges entry 'ab'"),
    ({"tokenizer.ggml.merges": ["a q"]}, "merges do not fit"),
    ({"tokenizer.ggml.eos_token_id": 999}, "tokenizer.ggml.eos_token_id 999 is outside"),
    ({"tokenizer.ggml.add_bos_token": True}, "bos_token_id is missing"),
])
def test_bad_metadata_is_one_clear_error(change: dict, message: str):
    with pytest.raises(EngineError, match=message) as info:
        Tokenizer.from_metadata(byte_vocab_metadata(**change), "bad.gguf")
    assert str(info.value).startswith("bad.gguf: ")


def test_file_without_tokenizer_is_an_engine_error(tmp_path: Path):
    path = tmp_path / "no_vocab.gguf"
    writer = GGUFWriter(path, "qwen35moe")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(EngineError, match="no tokenizer metadata"):
        Tokenizer.from_gguf(path)
    with pytest.raises(EngineError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
