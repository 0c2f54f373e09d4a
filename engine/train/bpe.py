"""A small byte-level BPE tokenizer trained on the offline corpus, exported as GGUF metadata.

It splits text with the qwen35 pre-tokenizer regex, so once written into a GGUF file it
loads through ``engine.tokenizer.Tokenizer`` and llama.cpp alike.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import CONTROL, NORMAL, QWEN35_PATTERN, USER_DEFINED
from engine.train.corpus import iter_documents

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def empty_tokenizer() -> HFTokenizer:
    """An untrained BPE with the qwen35 pre-tokenizer and byte-level decoding."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sample(files: Sequence[str | os.PathLike[str]], seed: int, max_bytes: int | None) -> list[str]:
    docs = [doc for path in files for doc in iter_documents(path)]
    if max_bytes is None:
        return docs
    random.Random(seed).shuffle(docs)
    out, used = [], 0
    for doc in docs:
        if used >= max_bytes:
            break
        out.append(doc)
        used += len(doc.encode("utf-8"))
    return out


def train_bpe(files: Sequence[str | os.PathLike[str]], vocab_size: int = 4096, *, seed: int,
              max_bytes: int | None = None, min_frequency: int = 2) -> HFTokenizer:
    """Train on the documents of corpus ``files`` (``engine.train.corpus`` format).

    ``max_bytes`` trains on a seeded random sample of documents of about that size; without
    it every document is used and ``seed`` changes nothing. The special tokens take ids 0-2
    and all 256 byte symbols follow, so any text can be encoded.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    smallest = len(SPECIAL_TOKENS) + len(alphabet)
    if vocab_size <= smallest:
        raise ValueError(f"vocab_size must exceed {smallest} (special tokens and the byte alphabet), "
                         f"got {vocab_size}")
    if not files:
        raise ValueError("train_bpe needs at least one corpus file")
    docs = _sample(files, seed, max_bytes)
    if not docs:
        raise ValueError(f"the corpus files {[str(f) for f in files]} hold no documents")
    tok = empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=sorted(alphabet))
    tok.train_from_iterator(docs, trainer, length=len(docs))
    return tok


def _merges(tok: HFTokenizer) -> list[str]:
    model = json.loads(tok.to_str())["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"expected a BPE tokenizer, got a {model.get('type')} model")
    # tokenizers writes merges as [left, right] pairs (older versions as "left right")
    return [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]


def gguf_tokenizer_metadata(tok: HFTokenizer, *, chat_template: str | None = CHATML_TEMPLATE) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` keys llama.cpp's converter writes for this gpt2-style tokenizer.

    Values are plain Python; ``engine.gguf.writer`` gives the standard keys their GGUF types
    (ids uint32, token_type an int32 array, tokens and merges string arrays).
    """
    n = tok.get_vocab_size(with_added_tokens=True)
    tokens = [tok.id_to_token(i) for i in range(n)]
    if any(t is None for t in tokens):
        raise ValueError(f"token ids of this tokenizer are not contiguous in 0..{n - 1}")
    added = tok.get_added_tokens_decoder()
    types = [NORMAL] * n
    for i, token in added.items():
        types[i] = CONTROL if token.special else USER_DEFINED
    eos = tok.token_to_id(SPECIAL_TOKENS[0])
    if eos is None:
        raise ValueError(f"the tokenizer has no {SPECIAL_TOKENS[0]} token")
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": _merges(tok),
        "tokenizer.ggml.eos_token_id": eos,
        "tokenizer.ggml.padding_token_id": eos,
        "tokenizer.ggml.bos_token_id": eos,
        "tokenizer.ggml.add_bos_token": False,
    }
    if chat_template is not None:
        md["tokenizer.chat_template"] = chat_template
    return md

