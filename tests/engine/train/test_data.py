"""The family's training data with more sources and a borrowed tokenizer."""

from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from engine.train.corpus import iter_documents
from engine.train.data import CorpusSettings, prepare_data

SHIPPED = Path(__file__).resolve().parents[3] / "models" / "luce-target.gguf"
SMALL = dict(n_retrieval=2, max_bytes=150_000, retrieval_tokens=(128,))


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("extra") / "pkg"
    root.mkdir()
    for i in range(12):
        (root / f"mod{i}.py").write_text(f'"""Module {i}."""\n\n' + "".join(
            f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(40)))
    return root


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("plain"), CorpusSettings(tokenizer_from=str(SHIPPED), **SMALL))


def test_borrowed_tokenizer_and_extra_sources(plain, package, tmp_path):
    data = prepare_data(tmp_path, CorpusSettings(tokenizer_from=str(SHIPPED), extra_dirs=(str(package),), **SMALL))
    shipped = Tokenizer.from_gguf(SHIPPED)
    assert tuple(data.tokenizer_metadata["tokenizer.ggml.tokens"]) == tuple(shipped.spec.tokens)
    assert not (tmp_path / "tokenizer.json").exists()  # none trained
    s = data.stats
    extra_docs = list(iter_documents(tmp_path / "corpus" / "extra_train.txt"))
    assert s["extra_documents"] == 12 == len(extra_docs)
    assert s["extra_tokens"] == sum(len(shipped.encode(d)) + 1 for d in extra_docs)  # each with its separator
    assert s["library_tokens"] + s["extra_tokens"] == s["train_tokens"] == len(data.streams.train)
    assert s["library_tokens"] == plain.stats["train_tokens"] and plain.stats["extra_tokens"] == 0
    # the library's text comes first, then the extra sources; held-out text is the same as without them
    assert data.streams.train.ids[: s["library_tokens"]].tolist() == plain.streams.train.ids.tolist()
    assert data.streams.heldout.ids.tolist() == plain.streams.heldout.ids.tolist()
    assert s["tokenizer"] == str(SHIPPED)


def test_bad_sources_and_tokenizer_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="nowhere"):
        CorpusSettings(extra_dirs=(str(tmp_path / "nowhere"),))
    with pytest.raises(ValueError, match="missing.gguf"):
        CorpusSettings(tokenizer_from=str(tmp_path / "missing.gguf"))
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("plain text, not a GGUF file\n")
    with pytest.raises(ValueError, match="text.gguf"):
        prepare_data(tmp_path / "d", CorpusSettings(tokenizer_from=str(not_gguf), **SMALL))


def test_train_command_names_a_missing_source_folder(tmp_path, capsys):
    from engine.train.cli import main

    status = main(["train", "--preset", "micro", "--steps", "1", "--out-dir", str(tmp_path / "m"),
                   "--extra-sources", str(tmp_path / "nowhere")])
    err = " ".join(capsys.readouterr().err.split())
    assert status == 2 and "Traceback" not in err and "nowhere" in err and "extra source folder" in err
    assert not (tmp_path / "m").exists()


def test_model_card_names_the_extra_sources():
    from engine.train.model_card import _sources

    library = {"train_tokens": 3_000, "train_documents": 5, "extra_tokens": 0}
    assert _sources(library) == "3,000 tokens of library source (5 files)"
    both = {"train_tokens": 10_000, "train_documents": 9, "library_tokens": 3_000, "library_documents": 5,
            "extra_tokens": 7_000, "extra_documents": 4, "settings": {"extra_dirs": ["/x/site/torch", "/y/numpy"]}}
    assert _sources(both) == ("3,000 tokens of library source (5 files), 7,000 of other Python sources "
                              "(4 files from `torch`, `numpy`)")
