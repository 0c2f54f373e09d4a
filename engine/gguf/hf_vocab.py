"""``tokenizer.*`` GGUF keys from a HF checkpoint's byte-level BPE tokenizer, as llama.cpp's
converter writes them (``TextModel._set_vocab_gpt2`` with ``get_vocab_base`` and gguf-py's
``SpecialVocab``): every id below ``vocab_size`` gets a token, ids the tokenizer lacks become
``[PAD{i}]`` (UNUSED); added tokens are CONTROL when special or shaped ``<|...|>``, else
USER_DEFINED; merges, special token ids, add-token flags and the chat template come from
``SpecialVocab``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
from gguf import Keys, TokenType

from engine.errors import ConfigError

PRE = "qwen35"  # llama.cpp's pre-tokenizer name for the Qwen3.5/3.6 vocabulary
# special token types GGUFWriter has keys for (SpecialVocab also reads "cls", which it skips)
_ID_KEYS = {"bos": Keys.Tokenizer.BOS_ID, "eos": Keys.Tokenizer.EOS_ID, "unk": Keys.Tokenizer.UNK_ID,
            "sep": Keys.Tokenizer.SEP_ID, "pad": Keys.Tokenizer.PAD_ID, "mask": Keys.Tokenizer.MASK_ID}
_ADD_KEYS = {"bos": Keys.Tokenizer.ADD_BOS, "eos": Keys.Tokenizer.ADD_EOS, "sep": Keys.Tokenizer.ADD_SEP}


def _looks_special(text: str) -> bool:
    return text.startswith("<|") and text.endswith("|>")


def tokenizer_metadata_from_hf(directory: str | Path, vocab_size: int) -> dict[str, Any]:
    """The ``tokenizer.*`` keys for ``directory``'s tokenizer.json, padded to ``vocab_size`` tokens."""
    from tokenizers import Tokenizer

    directory = Path(directory)
    path = directory / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ConfigError(f"{path}: cannot be read as a tokenizer ({exc})") from None
    vocab = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    if vocab and max(vocab) >= vocab_size:
        raise ConfigError(f"{path}: token id {max(vocab)} is outside the model's vocab_size {vocab_size}")
    added = tok.get_added_tokens_decoder()

    tokens, types = [], []
    for i in range(vocab_size):
        text = vocab.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            tokens.append(text)
            types.append(TokenType.CONTROL if added[i].special or _looks_special(text) else TokenType.USER_DEFINED)
        else:
            tokens.append(text)
            types.append(TokenType.NORMAL)

    special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=vocab_size)
    if not special.merges:
        raise ConfigError(f"{path}: no BPE merges found (a gpt2-style tokenizer needs them)")
    md: dict[str, Any] = {
        Keys.Tokenizer.MODEL: "gpt2",
        Keys.Tokenizer.PRE: PRE,
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.TOKEN_TYPE: [int(t) for t in types],
        Keys.Tokenizer.MERGES: list(special.merges),
    }
    md |= {_ID_KEYS[typ]: int(i) for typ, i in special.special_token_ids.items() if typ in _ID_KEYS}
    md |= {_ADD_KEYS[typ]: bool(v) for typ, v in special.add_special_token.items() if typ in _ADD_KEYS}
    template = special.chat_template
    if isinstance(template, str):
        md[Keys.Tokenizer.CHAT_TEMPLATE] = template
    elif template:  # named templates, stored as GGUFWriter.add_chat_template stores them
        names = []
        for entry in template:
            name = "".join(c if c.isascii() and c.isalnum() else "_" for c in entry.get("name", ""))
            text = entry.get("template")
            if not name or text is None:
                continue
            if name == "default":
                md[Keys.Tokenizer.CHAT_TEMPLATE] = text
            else:
                names.append(name)
                md[Keys.Tokenizer.CHAT_TEMPLATE_N.format(name=name)] = text
        if names:
            md[Keys.Tokenizer.CHAT_TEMPLATES] = names
    return md
