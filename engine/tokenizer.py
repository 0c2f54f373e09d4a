"""Byte-level BPE tokenizer built from a GGUF file's own ``tokenizer.ggml.*`` metadata.

Encoding runs in the ``tokenizers`` library with the pre-tokenizer regexes llama.cpp uses
for each ``tokenizer.ggml.pre`` name, so ids match llama.cpp's. Decoding follows llama.cpp's
piece rules per token type (normal tokens are byte-level decoded, control and user-defined
tokens are copied as text, unused tokens render as nothing) and is lossless: the space
clean-up llama.cpp applies for some older pre-tokenizers (not the Qwen ones) is left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from os import PathLike
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import EngineError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # gguf.TokenType

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
QWEN35_PATTERN = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one ``tokenizer.ggml.pre`` name.

    Each pattern further splits the pieces the previous one produced; matches and the
    text between them both become pieces.
    """

    patterns: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is already a token is not merged up
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token

    def __post_init__(self) -> None:
        if not self.patterns:
            raise ValueError("a pre-tokenizer needs at least one pattern")


_QWEN35 = PreTokenizer((QWEN35_PATTERN,))
_QWEN2 = PreTokenizer((QWEN2_PATTERN,))
_LLAMA3 = PreTokenizer((LLAMA3_PATTERN,), ignore_merges=True, add_bos=True)
_GPT2 = PreTokenizer((GPT2_PATTERN,))
_STARCODER = PreTokenizer((r"\p{N}", GPT2_PATTERN))
_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]"))

PRE_TOKENIZERS: Mapping[str, PreTokenizer] = {
    "qwen35": _QWEN35,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "kormo": _QWEN2, "f2llmv2": _QWEN2,
    "stablelm2": _QWEN2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "falcon-h1": _LLAMA3, "pixtral": _LLAMA3, "midm-2.0": _LLAMA3, "lfm2": _LLAMA3,
    "dbrx": PreTokenizer((LLAMA3_PATTERN,)), "smaug-bpe": PreTokenizer((LLAMA3_PATTERN,)),
    "gpt-2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "starcoder": _STARCODER, "refact": _STARCODER, "command-r": _STARCODER,
    "default": _DEFAULT,
}

# Tokens llama.cpp treats as end of generation (and as control tokens) by their text alone.
END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})

_KEY = "tokenizer.ggml."


def _splits(pre: PreTokenizer) -> list[pre_tokenizers.PreTokenizer]:
    return [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre.patterns]


def pre_tokenize(pre: str, text: str) -> list[str]:
    """The pieces the pre-tokenizer named ``pre`` cuts ``text`` into before BPE merges."""
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unknown pre-tokenizer {pre!r}, expected one of {sorted(PRE_TOKENIZERS)}")
    split = pre_tokenizers.Sequence(_splits(PRE_TOKENIZERS[pre]))
    return [piece for piece, _ in split.pre_tokenize_str(text)]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass(frozen=True)
class TokenizerSpec:
    """Validated contents of a GGUF file's ``tokenizer.ggml.*`` keys."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    pre: str
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0:
            raise ValueError("tokenizer.ggml.tokens is empty")
        if len(self.token_types) != n:
            raise ValueError(f"tokenizer.ggml.token_type has {len(self.token_types)} entries, expected {n}")
        if self.pre not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre is {self.pre!r}, expected one of {sorted(PRE_TOKENIZERS)}")
        bad_type = next((t for t in self.token_types if not NORMAL <= t <= BYTE), None)
        if bad_type is not None:
            raise ValueError(f"tokenizer.ggml.token_type holds {bad_type}, expected 1..6")
        bad_merge = next((m for m in self.merges if m.find(" ", 1) < 0), None)
        if bad_merge is not None:
            raise ValueError(f"tokenizer.ggml.merges entry {bad_merge!r} is not two tokens separated by a space")
        for name, key in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"), ("pad_id", "padding_token_id"),
                          ("eot_id", "eot_token_id"), ("eom_id", "eom_token_id")):
            value = getattr(self, name)
            if value is not None and not 0 <= value < n:
                raise ValueError(f"tokenizer.ggml.{key} {value} is outside the vocabulary of {n} tokens")
        if self.add_bos and self.bos_id is None:
            raise ValueError("add_bos_token is true but bos_token_id is missing")
        if self.add_eos and self.eos_id is None:
            raise ValueError("add_eos_token is true but eos_token_id is missing")

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], source: str) -> "TokenizerSpec":
        model = md.get(_KEY + "model")
        if model is None or _KEY + "tokens" not in md:
            raise EngineError(f"{source}: no tokenizer metadata (tokenizer.ggml.model and tokenizer.ggml.tokens)")
        if model != "gpt2":
            raise EngineError(f"{source}: tokenizer.ggml.model is {model!r}, expected 'gpt2' (byte-level BPE)")
        if _KEY + "merges" not in md:
            raise EngineError(f"{source}: tokenizer.ggml.merges is missing, a gpt2 tokenizer needs it")
        tokens = tuple(md[_KEY + "tokens"])
        types = md.get(_KEY + "token_type")
        pre = md.get(_KEY + "pre") or "default"
        pre_spec = PRE_TOKENIZERS.get(pre)

        def token_id(key: str) -> int | None:
            value = md.get(_KEY + key)
            return None if value is None else int(value)

        add_bos = md.get(_KEY + "add_bos_token")
        try:
            return cls(
                tokens=tokens,
                token_types=tuple(int(t) for t in types) if types is not None else (NORMAL,) * len(tokens),
                merges=tuple(md[_KEY + "merges"]),
                pre=pre,
                bos_id=token_id("bos_token_id"),
                eos_id=token_id("eos_token_id"),
                pad_id=token_id("padding_token_id"),
                eot_id=token_id("eot_token_id"),
                eom_id=token_id("eom_token_id"),
                add_bos=bool(add_bos) if add_bos is not None else bool(pre_spec and pre_spec.add_bos),
                add_eos=bool(md.get(_KEY + "add_eos_token", False)),
                chat_template=md.get("tokenizer.chat_template"),
            )
        except ValueError as exc:
            raise EngineError(f"{source}: {exc}") from None


class Tokenizer:
    """Encode and decode text exactly as llama.cpp does for the same GGUF vocabulary."""

    def __init__(self, spec: TokenizerSpec, *, source: str = "GGUF") -> None:
        self.spec = spec
        self.source = source
        types = list(spec.token_types)
        for i, text in enumerate(spec.tokens):
            if text in END_OF_TURN_TEXTS:
                types[i] = CONTROL
        self._types = tuple(types)
        self._tok = self._build(spec, self._types, source)
        self._pieces: dict[int, bytes] = {}
        self._char_byte = {c: b for b, c in byte_to_unicode().items()}

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], source: str) -> "Tokenizer":
        return cls(TokenizerSpec.from_metadata(md, source), source=source)

    @classmethod
    def from_gguf(cls, path: str | PathLike[str]) -> "Tokenizer":
        return cls.from_metadata(_read_metadata(path), str(path))

    @staticmethod
    def _build(spec: TokenizerSpec, types: Sequence[int], source: str) -> HFTokenizer:
        pre = PRE_TOKENIZERS[spec.pre]
        vocab = {text: i for i, text in enumerate(spec.tokens)}
        merges = [(m[:cut], m[cut + 1:]) for m in spec.merges for cut in (m.find(" ", 1),)]
        try:
            tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
        except Exception as exc:  # tokenizers raises plain Exception for merges outside the vocab
            raise EngineError(f"{source}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {exc}") from None
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            _splits(pre) + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(spec.tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t in (CONTROL, UNKNOWN) and spec.tokens[i]])
        tok.add_tokens([AddedToken(spec.tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == USER_DEFINED and spec.tokens[i]])
        return tok

    @cached_property
    def _tok_plain(self) -> HFTokenizer:
        """A copy that reads control tokens in the text as ordinary text."""
        tok = HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    @property
    def vocab_size(self) -> int:
        return len(self.spec.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.spec.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.spec.eos_id

    @property
    def pad_id(self) -> int | None:
        return self.spec.pad_id

    @cached_property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: eos, eot/eom and end-of-turn tokens such as <|im_end|>."""
        ids = {i for i in (self.spec.eos_id, self.spec.eot_id, self.spec.eom_id) if i is not None}
        ids |= {i for i, text in enumerate(self.spec.tokens) if text in END_OF_TURN_TEXTS}
        return tuple(sorted(ids))

    @property
    def chat_template(self) -> str | None:
        return self.spec.chat_template

    def token_type(self, token_id: int) -> int:
        """The gguf.TokenType of ``token_id`` as llama.cpp uses it."""
        self._check_id(token_id)
        return self._types[token_id]

    def encode(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds bos/eos where the file asks for them.

        With ``parse_special`` control tokens written in the text (``<|im_start|>``) become
        their ids; without it they are tokenized as plain text. User-defined tokens are
        always matched, as in llama.cpp.
        """
        tok = self._tok if parse_special else self._tok_plain
        ids = tok.encode(text, add_special_tokens=False).ids
        return self._add_special(ids) if add_special else ids

    def encode_batch(self, texts: Iterable[str], *, add_special: bool = False,
                     parse_special: bool = True) -> list[list[int]]:
        """``encode`` of each text, run in parallel threads by the tokenizers library."""
        tok = self._tok if parse_special else self._tok_plain
        batch = [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]
        return [self._add_special(ids) for ids in batch] if add_special else batch

    def _add_special(self, ids: list[int]) -> list[int]:
        head = [self.spec.bos_id] if self.spec.add_bos else []
        tail = [self.spec.eos_id] if self.spec.add_eos else []
        return head + ids + tail

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (a multi-byte character cut in two) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        out = []
        for i in ids:
            i = int(i)
            if skip_special and self._check_id(i) in (CONTROL, UNKNOWN):
                continue
            piece = self._pieces.get(i)
            if piece is None:
                piece = self._pieces[i] = self._piece(i)
            out.append(piece)
        return b"".join(out)

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._types):
            raise EngineError(
                f"{self.source}: token id {token_id} is outside the vocabulary of {len(self._types)} tokens")
        return self._types[token_id]

    def _piece(self, token_id: int) -> bytes:
        kind = self._check_id(token_id)
        text = self.spec.tokens[token_id]
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            return text.encode("utf-8")
        if kind == NORMAL:
            char_byte = self._char_byte
            return b"".join(bytes((char_byte[c],)) if c in char_byte else c.encode("utf-8") for c in text)
        if kind == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes((int(text[3:5], 16),))
        return b""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, **variables: Any) -> str:
        """Render ``messages`` with the file's ``tokenizer.chat_template`` (Jinja)."""
        template = self._template
        special = {name: self.spec.tokens[i] if i is not None else ""
                   for name, i in (("bos_token", self.spec.bos_id), ("eos_token", self.spec.eos_id))}
        try:
            return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                   **(special | variables))
        except _TemplateRaised as exc:
            raise EngineError(f"{self.source}: the chat template rejected the messages: {exc}") from None


    @cached_property
    def _template(self):
        if self.spec.chat_template is None:
            raise EngineError(f"{self.source}: tokenizer.chat_template is missing, cannot format chat messages")
        return _compile_template(self.spec.chat_template, self.source)


class _TemplateRaised(Exception):
    """``raise_exception(...)`` called from inside a chat template."""


def _compile_template(source_text: str, source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise _TemplateRaised(message)

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes <, > and & for HTML, which changes what the model sees.
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        import datetime
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source_text)
    except jinja2.TemplateSyntaxError as exc:
        raise EngineError(f"{source}: tokenizer.chat_template is not valid Jinja: {exc}") from None


def _read_metadata(path: str | PathLike[str]) -> dict[str, Any]:
    from engine.gguf.reader import GGUFFile

    with GGUFFile(path) as f:
        return {key: value for key, value in f.metadata.items() if key.startswith("tokenizer.")}
