"""The family's training data: the offline corpus, tokenized with the project's BPE.

The tokenizer is trained once and kept in the data directory, so a resumed run and every
member of the family read the same token ids; text is encoded through the engine's own
``Tokenizer`` built from the GGUF metadata that ships in the files. ``tokenizer_from`` takes
the tokenizer of an existing GGUF instead (a retrained target then reads the same ids as the
shipped family).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.train.batches import TokenStream
from engine.train.train_target import TrainData

TOKENIZER_FILE = "tokenizer.json"
ANSWER_MARK = " It is"  # engine.train.corpus.retrieval_example ends every example with " It is <code>."


@dataclass(frozen=True)
class CorpusSettings:
    seed: int = 0
    vocab_size: int = 4096
    n_retrieval: int = 4000
    held_out_fraction: float = 0.05
    max_bytes: int | None = None  # library bytes, both splits together
    bpe_max_bytes: int | None = 8_000_000
    # nominal lengths (engine.train.corpus); with this BPE about 1.23 tokens per nominal one:
    # the three shortest fit the 512-token rows of the first training phase, the longest
    # (about 3.7K tokens) the 4096-token rows of the last
    retrieval_tokens: tuple[int, ...] = (128, 256, 384, 1024, 2048, 3000)
    extra_dirs: tuple[str, ...] = ()  # folders of more Python sources, training split only
    extra_max_bytes: int | None = None
    tokenizer_from: str | None = None  # a GGUF whose tokenizer is used instead of training one

    def __post_init__(self) -> None:
        if self.vocab_size <= 0 or self.n_retrieval < 0:
            raise ValueError(f"vocab_size {self.vocab_size} must be positive and n_retrieval "
                             f"{self.n_retrieval} non-negative")
        for d in self.extra_dirs:
            if not Path(d).is_dir():
                raise ValueError(f"extra source folder {d} does not exist or is not a folder")
        if self.extra_max_bytes is not None and self.extra_max_bytes <= 0:
            raise ValueError(f"extra_max_bytes must be positive, got {self.extra_max_bytes}")
        if self.tokenizer_from is not None and not Path(self.tokenizer_from).is_file():
            raise ValueError(f"tokenizer file {self.tokenizer_from} does not exist")


@dataclass(frozen=True)
class RetrievalCase:
    """A held-out retrieval example: the model must produce ``ids[answer_start:]`` from the rest."""

    ids: tuple[int, ...]
    answer_start: int

    def __post_init__(self) -> None:
        if not 0 < self.answer_start < len(self.ids):
            raise ValueError(f"answer_start {self.answer_start} must lie inside the {len(self.ids)} ids")


@dataclass(frozen=True)
class FamilyData:
    streams: TrainData
    retrieval_cases: tuple[RetrievalCase, ...]
    tokenizer_metadata: dict[str, Any]
    stats: dict[str, Any]
    heldout_text: Path | None = None  # the held-out library text (NIAH haystacks)


def prepare_data(data_dir: Path, settings: CorpusSettings) -> FamilyData:
    """Build the corpus under ``data_dir``, train or reuse the tokenizer, tokenize every split."""
    from tokenizers import Tokenizer as HFTokenizer

    from engine.tokenizer import Tokenizer
    from engine.train.bpe import gguf_tokenizer_metadata, train_bpe
    from engine.train.corpus import build_corpus, iter_documents

    files = build_corpus(data_dir / "corpus", seed=settings.seed, held_out_fraction=settings.held_out_fraction,
                         n_retrieval=settings.n_retrieval, max_bytes=settings.max_bytes,
                         retrieval_tokens=settings.retrieval_tokens, extra_dirs=settings.extra_dirs,
                         extra_max_bytes=settings.extra_max_bytes)
    if settings.tokenizer_from is not None:
        metadata, tok_source = _tokenizer_metadata(settings.tokenizer_from), settings.tokenizer_from
    else:
        tok_path = data_dir / TOKENIZER_FILE
        if tok_path.exists():
            hf_tok = HFTokenizer.from_file(str(tok_path))
        else:
            hf_tok = train_bpe([files.train, files.retrieval_train], settings.vocab_size, seed=settings.seed,
                               max_bytes=settings.bpe_max_bytes)
            hf_tok.save(str(tok_path))
        metadata, tok_source = gguf_tokenizer_metadata(hf_tok), str(tok_path)
    tok = Tokenizer.from_metadata(metadata, source=tok_source)
    eos = tok.eos_id

    def encoded(path: Path) -> list[list[int]]:
        return tok.encode_batch(list(iter_documents(path)))

    def stream(docs: list[list[int]]) -> TokenStream:
        return TokenStream.from_documents(docs, separator=eos)

    library_docs = encoded(files.train)
    library = stream(library_docs)
    train = stream(library_docs + encoded(files.extra_train)) if files.extra_train is not None else library
    heldout = stream(encoded(files.held_out))
    examples = stream(encoded(files.retrieval_train)) if settings.n_retrieval else None
    cases = tuple(_retrieval_case(tok, text) for text in iter_documents(files.retrieval_held_out)) \
        if settings.n_retrieval else ()
    data = TrainData(train=train, heldout=heldout, vocab=tok.vocab_size, examples=examples,
                     bos_id=tok.bos_id, eos_id=eos, pad_id=tok.pad_id)
    stats = {"train_tokens": len(train), "train_documents": train.n_docs,
             "library_tokens": len(library), "library_documents": library.n_docs,
             "extra_tokens": len(train) - len(library), "extra_documents": train.n_docs - library.n_docs,
             "extra_bytes": files.extra_train.stat().st_size if files.extra_train is not None else 0,
             "tokenizer": tok_source,
             "heldout_tokens": len(heldout), "heldout_documents": heldout.n_docs,
             "retrieval_train_tokens": len(examples) if examples is not None else 0,
             "retrieval_train_examples": examples.n_docs if examples is not None else 0,
             "retrieval_heldout_examples": len(cases), "vocab": tok.vocab_size,
             "train_bytes": files.train.stat().st_size, "heldout_bytes": files.held_out.stat().st_size,
             "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.__dict__.items()}}
    return FamilyData(streams=data, retrieval_cases=cases, tokenizer_metadata=metadata, stats=stats,
                      heldout_text=files.held_out)


def _tokenizer_metadata(path: str) -> dict[str, Any]:
    """The ``tokenizer.*`` keys of a GGUF file; ``ValueError`` when it has no tokenizer."""
    from engine.errors import EngineError
    from engine.tokenizer import _read_metadata

    try:
        md = _read_metadata(path)
    except EngineError as exc:
        raise ValueError(f"tokenizer file {path}: {exc}") from None
    if "tokenizer.ggml.tokens" not in md:
        raise ValueError(f"tokenizer file {path} holds no tokenizer (no tokenizer.ggml.tokens)")
    return md


def _retrieval_case(tok, text: str) -> RetrievalCase:
    """The example with its answer span: the code's digits and the closing period."""
    cut = text.rfind(ANSWER_MARK)
    if cut <= 0:
        raise ValueError(f"held-out retrieval example ends with {text[-40:]!r}, without {ANSWER_MARK!r}")
    cut += len(ANSWER_MARK)
    context, answer = tok.encode(text[:cut]), tok.encode(text[cut:])
    if context + answer != tok.encode(text):
        raise ValueError(f"the answer {text[cut:]!r} does not start on a token boundary")
    return RetrievalCase(ids=tuple(context + answer), answer_start=len(context))
