import random
import re
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from engine.train.corpus import (RETRIEVAL_TOKENS, SEPARATOR, build_corpus, is_held_out, iter_documents,
                                 retrieval_example, stdlib_sources, write_documents)

VOCAB = Path(__file__).resolve().parents[4] / "shared" / "data" / "ggml-vocab-qwen35.gguf"
FACT = re.compile(r"The secret code of (\w+ \w+) is (\d{5})\.\n")
ANSWERED = re.compile(r"\n\nWhat is the secret code of (\w+ \w+)\? It is (\d{5})\.")
SMALL = dict(held_out_fraction=0.1, n_retrieval=6, max_bytes=400_000, retrieval_tokens=(256, 4096))


@pytest.fixture(scope="module")
def sources() -> dict[str, set[str]]:
    """Library file text -> the paths holding it (a few files are identical)."""
    out: dict[str, set[str]] = {}
    for s in stdlib_sources():
        out.setdefault(s.text, set()).add(s.path)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    return build_corpus(tmp_path_factory.mktemp("corpus"), seed=3, **SMALL)


def test_splits_are_disjoint_library_files_chosen_by_path(corpus, sources: dict[str, set[str]]):
    train = list(iter_documents(corpus.train))
    held = list(iter_documents(corpus.held_out))
    assert train and held
    assert all(any(not is_held_out(p, 0.1) for p in sources[doc]) for doc in train)
    assert all(any(is_held_out(p, 0.1) for p in sources[doc]) for doc in held)
    assert not set(train) & set(held)
    size = sum(len(d.encode()) for d in train + held)
    biggest = max(len(d.encode()) for d in train + held)
    assert size <= 400_000 + biggest


def test_held_out_share_matches_the_fraction(sources: dict[str, set[str]]):
    paths = [p for group in sources.values() for p in group]
    share = sum(is_held_out(p, 0.05) for p in paths) / len(paths)
    assert len(paths) > 500
    assert abs(share - 0.05) < 0.02


def test_build_is_deterministic_and_seed_only_moves_retrieval(corpus, tmp_path: Path):
    same = build_corpus(tmp_path / "same", seed=3, **SMALL)
    other = build_corpus(tmp_path / "other", seed=4, **SMALL)
    for field in ("train", "held_out", "retrieval_train", "retrieval_held_out"):
        assert getattr(same, field).read_bytes() == getattr(corpus, field).read_bytes()
    assert other.train.read_bytes() == corpus.train.read_bytes()
    assert other.retrieval_train.read_bytes() != corpus.retrieval_train.read_bytes()


def test_training_examples_ask_every_fact_held_out_ones_ask_one(corpus):
    docs = list(iter_documents(corpus.retrieval_train))
    held = list(iter_documents(corpus.retrieval_held_out))
    assert len(docs) == 6 and len(held) == 1
    for doc in docs:
        facts = dict(m.groups() for m in FACT.finditer(doc))
        asked = ANSWERED.findall(doc)
        assert 1 <= len(facts) <= 6
        assert sorted(name for name, _ in asked) == sorted(facts)  # every fact asked once
        assert all(facts[name] == code for name, code in asked)
    for doc in held:
        facts = dict(m.groups() for m in FACT.finditer(doc))
        (name, code), = ANSWERED.findall(doc)
        assert 1 <= len(facts) <= 3 and facts[name] == code


def test_facts_land_at_every_depth():
    srcs = [s for _, s in zip(range(20), stdlib_sources())]
    rng = random.Random(0)
    depths = []
    for _ in range(200):
        ex = retrieval_example(rng, srcs, context_chars=3000, n_facts=1)
        depths.append(ex.context.index("The secret code of") / len(ex.context))
    assert min(depths) < 0.1 and max(depths) > 0.85
    assert 0.35 < sum(depths) / len(depths) < 0.65


def test_longest_retrieval_examples_exceed_4k_tokens(tmp_path: Path):
    longest = (max(RETRIEVAL_TOKENS),)
    files = build_corpus(tmp_path, seed=0, n_retrieval=4, max_bytes=400_000, retrieval_tokens=longest)
    tok = Tokenizer.from_gguf(VOCAB)
    lengths = [len(tok.encode(doc)) for doc in iter_documents(files.retrieval_train)]
    assert min(lengths) >= 4096


def test_retrieval_example_places_every_fact():
    srcs = [s for _, s in zip(range(5), stdlib_sources())]
    ex = retrieval_example(random.Random(1), srcs, context_chars=2000, n_facts=5, n_questions=3)
    assert [m.groups() for m in FACT.finditer(ex.context)] == list(ex.facts)
    assert ex.text.endswith(f"What is the secret code of {ex.asked}? It is {dict(ex.facts)[ex.asked]}.")
    assert len(ANSWERED.findall(ex.text)) == 3
    assert 2000 <= len(ex.context) < 2000 + max(len(s.text) for s in srcs) + 300
    with pytest.raises(ValueError, match="n_questions"):
        retrieval_example(random.Random(1), srcs, context_chars=200, n_facts=2, n_questions=3)


def test_documents_round_trip_across_chunk_edges(tmp_path: Path):
    docs = ["a\r\nb", "x" * 30, "é€\n", "<|endoftext" + "|"]
    path = tmp_path / "docs.txt"
    assert write_documents(path, docs) == 4
    assert list(iter_documents(path, chunk_chars=7)) == docs
    assert list(iter_documents(path)) == docs
    with pytest.raises(ValueError, match="contains the separator"):
        write_documents(path, ["fine", "bad " + SEPARATOR])
    assert list(iter_documents(path)) == docs  # a failed write leaves the old file


@pytest.mark.parametrize("kwargs", [{"held_out_fraction": 0.0}, {"held_out_fraction": 1.0},
                                    {"n_retrieval": -1}, {"max_bytes": 0}, {"retrieval_tokens": ()}])
def test_bad_arguments(tmp_path: Path, kwargs: dict):
    with pytest.raises(ValueError):
        build_corpus(tmp_path, **kwargs)


def _package(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_extra_sources_skip_copies_caches_and_undecodable_files(tmp_path: Path):
    from engine.train.corpus import extra_sources

    library_text = next(iter(stdlib_sources())).text
    a = _package(tmp_path / "pkg_a", {"m.py": b"def a():\n    return 1\n", "sub/n.py": b"x = 2\n",
                                      "__pycache__/m.py": b"cached = 1\n", "copy.py": library_text.encode(),
                                      "latin.py": "s = 'caf\xe9'\n".encode("latin-1"), "blank.py": b"  \n",
                                      "notes.txt": b"not python\n"})
    b = _package(tmp_path / "pkg_b", {"same.py": b"def a():\n    return 1\n", "own.py": b"y = 3\n"})
    got = list(extra_sources([a, b], exclude=[library_text]))
    texts = [s.text for s in got]
    assert sorted(texts) == sorted(["def a():\n    return 1\n", "x = 2\n", "y = 3\n"])  # one of the two copies
    assert all(s.path.split("/")[0] in ("pkg_a", "pkg_b") for s in got)
    assert got == list(extra_sources([a, b], exclude=[library_text]))  # the same order every time
    with pytest.raises(ValueError, match="missing"):
        list(extra_sources([tmp_path / "missing"]))


def test_extra_sources_join_the_training_split_only(corpus, tmp_path: Path):
    text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(200))
    pkg = _package(tmp_path / "pkg", {f"mod{i}.py": f"# module {i}\n{text}".encode() for i in range(30)})
    files = build_corpus(tmp_path / "c", seed=3, extra_dirs=[pkg], **SMALL)
    for field in ("train", "held_out", "retrieval_train", "retrieval_held_out"):
        assert getattr(files, field).read_bytes() == getattr(corpus, field).read_bytes()
    extra = list(iter_documents(files.extra_train))
    assert len(extra) == 30 and all(doc.startswith("# module") for doc in extra)
    assert corpus.extra_train is None
    capped = build_corpus(tmp_path / "capped", seed=3, extra_dirs=[pkg], extra_max_bytes=len(extra[0]) * 5 + 10,
                          **SMALL)
    assert len(list(iter_documents(capped.extra_train))) == 5
    empty = _package(tmp_path / "empty", {"a.txt": b"no sources\n"})
    with pytest.raises(ValueError, match="hold no usable .py file"):
        build_corpus(tmp_path / "none", seed=3, extra_dirs=[empty], **SMALL)
