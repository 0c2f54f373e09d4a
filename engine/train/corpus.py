"""An offline training corpus from text every machine has: the Python standard library.

Documents are the library's ``.py`` sources plus synthetic retrieval examples (facts placed
anywhere in a long stretch of real code, asked for at the end: every fact in a training
example, one in a held-out example). Each split is one plain
text file with every document followed by ``SEPARATOR``.

More training text may come from other folders of Python sources (``extra_dirs``: installed
packages, for example). It joins the training split only: the held-out split stays the
library's held-out files, so held-out figures compare across corpora, and an extra file
whose text equals any library file's is left out.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

SEPARATOR = "<|endoftext|>"
RESERVED = (SEPARATOR, "<|im_start|>", "<|im_end|>")  # never inside a document
# Lengths are set in characters, CHARS_PER_TOKEN per nominal token: the qwen35 vocabulary
# averages 4 to 4.6 characters per token on library sources, a 4K-token BPE fewer.
CHARS_PER_TOKEN = 4
RETRIEVAL_TOKENS = (256, 512, 1024, 2048, 4096, 8192)
TRAIN_FACTS = (1, 6)  # facts per training example, every one of them asked at the end
HELD_OUT_FACTS = (1, 3)  # facts per held-out example, one of them asked (a NIAH-like case)

FIRST_NAMES = ("Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas",
               "Kamala", "Lars", "Mei", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Sven", "Tariq",
               "Ursula", "Viktor", "Wanda", "Xavier", "Yara", "Zoltan")
LAST_NAMES = ("Abebe", "Bianchi", "Castro", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad", "Ivanova",
              "Jensen", "Kowalski", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Petrov", "Quispe",
              "Rossi", "Schmidt", "Tanaka", "Umarov", "Varga", "Weber", "Xu", "Yilmaz", "Zhou")


@dataclass(frozen=True)
class CorpusFiles:
    train: Path
    held_out: Path
    retrieval_train: Path
    retrieval_held_out: Path
    extra_train: Path | None = None  # training text from ``extra_dirs``, when any were given


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the standard library root, with forward slashes
    text: str


@dataclass(frozen=True)
class RetrievalExample:
    facts: tuple[tuple[str, str], ...]  # (name, code) in the order they appear
    asked: str  # the name the question asks about
    context: str  # facts and distractor text, ending with the question
    answer: str  # " It is <code>."

    @property
    def text(self) -> str:
        return self.context + self.answer


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _unit(label: str, rel_path: str) -> float:
    """A stable number in [0, 1) for a file: the same on every machine and Python run."""
    digest = hashlib.sha256(f"{label}:{rel_path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_held_out(rel_path: str, fraction: float) -> bool:
    return _unit("split", rel_path) < fraction


def stdlib_sources(root: Path | None = None) -> Iterator[SourceFile]:
    """Every UTF-8 ``.py`` file of the standard library, ordered by a hash of its path.

    Hash order makes any prefix a spread-out sample of the whole library. Installed
    third-party packages are left out: they differ between machines.
    """
    root = root or stdlib_root()
    paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts))
    for rel in sorted(paths, key=lambda r: (_unit("order", r), r)):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip() and not any(r in text for r in RESERVED):
            yield SourceFile(rel, text)


def extra_sources(dirs: Sequence[str | os.PathLike[str]], *, exclude: Iterable[str] = ()) -> Iterator[SourceFile]:
    """Every UTF-8 ``.py`` file under ``dirs`` whose text is not in ``exclude``, in hash order.

    Paths are named ``<folder name>/<path inside it>``. A text met twice (the same file in
    two folders, a module vendored twice) is kept once. Raises ``ValueError`` for a folder
    that does not exist.
    """
    seen = {hashlib.sha256(t.encode("utf-8")).digest() for t in exclude}
    files: list[tuple[str, Path]] = []
    for d in map(Path, dirs):
        if not d.is_dir():
            raise ValueError(f"extra source folder {d} does not exist or is not a folder")
        files += [(f"{d.name}/{p.relative_to(d).as_posix()}", p) for p in d.rglob("*.py")
                  if "__pycache__" not in p.relative_to(d).parts]
    for rel, p in sorted(files, key=lambda f: (_unit("order", f[0]), f[0])):
        try:
            text = p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if not text.strip() or digest in seen or any(r in text for r in RESERVED):
            continue
        seen.add(digest)
        yield SourceFile(rel, text)


def split_sources(sources: Iterable[SourceFile], held_out_fraction: float,
                  max_bytes: int | None = None) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out) by path hash; ``max_bytes`` bounds both together, shared by fraction."""
    budget = None if max_bytes is None else {
        False: max_bytes * (1 - held_out_fraction), True: max_bytes * held_out_fraction}
    used = {False: 0, True: 0}
    out: dict[bool, list[SourceFile]] = {False: [], True: []}
    for src in sources:
        held = is_held_out(src.path, held_out_fraction)
        size = len(src.text.encode("utf-8"))
        if budget is not None and out[held] and used[held] + size > budget[held]:
            if all(used[k] >= budget[k] * 0.9 for k in used):
                break
            continue
        out[held].append(src)
        used[held] += size
    return out[False], out[True]


def retrieval_example(rng: random.Random, sources: Sequence[SourceFile], *, context_chars: int,
                      n_facts: int = 1, n_questions: int = 1) -> RetrievalExample:
    """Facts "The secret code of <name> is <5 digits>." at random lines of real code, then questions.

    Facts go anywhere in the text, as a needle does at any depth. ``n_questions`` distinct
    names are asked in turn at the end, each question followed by its answer; the last
    answer is the example's ``answer`` and the earlier questions and answers belong to its
    context, so a training row teaches several retrievals and a held-out case scores one.
    """
    if not sources:
        raise ValueError("retrieval examples need at least one source file")
    if not 1 <= n_facts <= 8:
        raise ValueError(f"n_facts must be 1..8, got {n_facts}")
    if not 1 <= n_questions <= n_facts:
        raise ValueError(f"n_questions must be 1..n_facts ({n_facts}), got {n_questions}")
    names: list[str] = []
    while len(names) < n_facts:
        name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
        if name not in names:
            names.append(name)
    facts = tuple((name, str(rng.randint(10000, 99999))) for name in names)
    lines = distractor_lines(rng, sources, context_chars)
    before: dict[int, list[str]] = {}  # line index -> facts placed before that line
    for slot, (name, code) in zip(sorted(rng.randint(0, len(lines)) for _ in facts), facts):
        before.setdefault(slot, []).append(f"The secret code of {name} is {code}.\n")
    body: list[str] = []
    for i, line in enumerate(lines):
        body.extend(before.get(i, ()))
        body.append(line)
    body.extend(before.get(len(lines), ()))
    codes = dict(facts)
    asked = rng.sample(names, n_questions)
    context = "".join(body).rstrip()
    for name in asked[:-1]:
        context += f"\n\nWhat is the secret code of {name}? It is {codes[name]}."
    context += f"\n\nWhat is the secret code of {asked[-1]}?"
    return RetrievalExample(facts=facts, asked=asked[-1], context=context, answer=f" It is {codes[asked[-1]]}.")


def distractor_lines(rng: random.Random, sources: Sequence[SourceFile], n_chars: int) -> list[str]:
    """Whole lines of real source text, about ``n_chars`` long, from random places in random files."""
    out: list[str] = []
    total = 0
    while total < n_chars:
        lines = rng.choice(sources).text.splitlines(keepends=True)
        start = rng.randrange(len(lines))
        for line in lines[start:]:
            out.append(line)
            total += len(line)
            if total >= n_chars:
                break
        if out and not out[-1].endswith("\n"):
            out[-1] += "\n"
        out.append("\n")
    return out


def write_documents(path: Path, documents: Iterable[str]) -> int:
    """Write atomically, each document followed by SEPARATOR; returns the number written."""
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        for doc in documents:
            if SEPARATOR in doc:
                raise ValueError(f"a document for {path.name} contains the separator {SEPARATOR!r}")
            fh.write(doc)
            fh.write(SEPARATOR)
            count += 1
    os.replace(tmp, path)
    return count


def iter_documents(path: str | os.PathLike[str], *, chunk_chars: int = 1 << 20) -> Iterator[str]:
    """The documents of a corpus file, streamed; the exact text that was written."""
    pending = ""
    with open(path, encoding="utf-8", newline="") as fh:
        while chunk := fh.read(chunk_chars):
            pending += chunk
            *docs, pending = pending.split(SEPARATOR)
            yield from (d for d in docs if d)
    if pending:
        yield pending


def build_corpus(out_dir: str | os.PathLike[str], *, seed: int = 0, held_out_fraction: float = 0.05,
                 n_retrieval: int = 1000, max_bytes: int | None = None,
                 retrieval_tokens: Sequence[int] = RETRIEVAL_TOKENS,
                 extra_dirs: Sequence[str | os.PathLike[str]] = (),
                 extra_max_bytes: int | None = None) -> CorpusFiles:
    """Write the four corpus files under ``out_dir`` (five with ``extra_dirs``).

    The split of library files depends on their paths only, never on ``seed``, so a model
    trained with any seed is never evaluated on its own training files. ``seed`` drives
    the retrieval examples; ``n_retrieval`` training examples are written and
    ``held_out_fraction`` as many (at least one) held out, over held-out files only.
    ``extra_dirs`` adds their ``.py`` files (``extra_sources``), up to ``extra_max_bytes``,
    as ``extra_train.txt``; retrieval examples keep drawing on library files only.
    """
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    if n_retrieval < 0:
        raise ValueError(f"n_retrieval must be non-negative, got {n_retrieval}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if not retrieval_tokens or min(retrieval_tokens) <= 0:
        raise ValueError(f"retrieval_tokens must be positive lengths, got {tuple(retrieval_tokens)}")
    if extra_max_bytes is not None and extra_max_bytes <= 0:
        raise ValueError(f"extra_max_bytes must be positive, got {extra_max_bytes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    library = list(stdlib_sources())  # read once: split, and the texts extra sources must not repeat
    train, held_out = split_sources(library, held_out_fraction, max_bytes)
    if not train or not held_out:
        raise ValueError(f"the standard library at {stdlib_root()} gave {len(train)} training and "
                         f"{len(held_out)} held-out files; both must be non-empty")
    files = CorpusFiles(train=out / "train.txt", held_out=out / "held_out.txt",
                        retrieval_train=out / "retrieval_train.txt",
                        retrieval_held_out=out / "retrieval_held_out.txt",
                        extra_train=out / "extra_train.txt" if extra_dirs else None)
    if files.extra_train is not None:
        extra = _capped(extra_sources(extra_dirs, exclude=(s.text for s in library)), extra_max_bytes)
        if not extra:
            raise ValueError(f"the extra source folders {', '.join(map(str, extra_dirs))} hold no usable "
                             f".py file (UTF-8, not empty, not a copy of a library file)")
        write_documents(files.extra_train, (s.text for s in extra))
    write_documents(files.train, (s.text for s in train))
    write_documents(files.held_out, (s.text for s in held_out))
    n_held = max(1, round(n_retrieval * held_out_fraction)) if n_retrieval else 0
    for path, sources, count, label in ((files.retrieval_train, train, n_retrieval, "train"),
                                        (files.retrieval_held_out, held_out, n_held, "held_out")):
        rng = random.Random(f"retrieval:{label}:{seed}")
        write_documents(path, (_example(rng, sources, label == "train", retrieval_tokens).text
                               for _ in range(count)))
    return files


def _capped(sources: Iterable[SourceFile], max_bytes: int | None) -> list[SourceFile]:
    """Sources in order while they fit ``max_bytes`` (files that would pass it are skipped)."""
    out, used = [], 0
    for src in sources:
        size = len(src.text.encode("utf-8"))
        if max_bytes is not None and used + size > max_bytes:
            if used >= max_bytes * 0.99:
                break
            continue
        out.append(src)
        used += size
    return out


def _example(rng: random.Random, sources: Sequence[SourceFile], train: bool,
             retrieval_tokens: Sequence[int]) -> RetrievalExample:
    n_facts = rng.randint(*(TRAIN_FACTS if train else HELD_OUT_FACTS))
    return retrieval_example(rng, sources, n_facts=n_facts, n_questions=n_facts if train else 1,
                             context_chars=rng.choice(retrieval_tokens) * CHARS_PER_TOKEN)
