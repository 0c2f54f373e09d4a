from itertools import islice
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from engine.train.corpus import stdlib_sources, write_documents
from tuner.workloads import (NiahCase, code_prompts, haystack_text, long_form_prompts, niah_case,
                             niah_grid, score_niah)

VOCAB = Path(__file__).resolve().parents[3] / "shared" / "data" / "ggml-vocab-qwen35.gguf"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(VOCAB)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    docs = [s.text for s in islice(stdlib_sources(), 12)]
    path = tmp_path_factory.mktemp("workloads") / "held_out.txt"
    write_documents(path, docs)
    return path, docs


@pytest.fixture(scope="module")
def haystack() -> str:
    return haystack_text(60_000)


def test_code_prompts_are_distinct_seeded_humaneval_problems():
    a = code_prompts(5, seed=0)
    assert a.name == "code" and len(a) == 5
    assert len({p.id for p in a}) == 5 and all(p.id.startswith("HumanEval/") for p in a)
    assert all("def " in p.text and '"""' in p.text for p in a)
    assert code_prompts(5, seed=0) == a
    assert code_prompts(5, seed=1) != a
    assert len(code_prompts(164, seed=0)) == 164
    with pytest.raises(ValueError, match="0..164"):
        code_prompts(165, seed=0)


def test_long_form_prompts_are_line_aligned_cuts_of_the_requested_length(tok: Tokenizer, held_out):
    path, docs = held_out
    prompts = long_form_prompts(path, 4, 256, tok, seed=0)
    assert [p.id for p in prompts] == [f"long_form/{i}" for i in range(4)]
    assert len({p.text for p in prompts}) == 4
    for p in prompts:
        assert abs(len(tok.encode(p.text)) - 256) <= 2  # a cut mid-word may re-merge at the edge
        doc = next(d for d in docs if p.text[:200] in d)
        at = doc.index(p.text[:200])
        assert at == 0 or doc[at - 1] == "\n"
    assert long_form_prompts(path, 4, 256, tok, seed=0) == prompts
    assert long_form_prompts(path, 4, 256, tok, seed=1) != prompts


def test_long_form_prompts_reuse_documents_only_when_needed(tok: Tokenizer, tmp_path: Path):
    path = tmp_path / "one.txt"
    write_documents(path, ["".join(f"line {i} of the only document\n" for i in range(400))])
    prompts = long_form_prompts(path, 3, 64, tok, seed=0)
    assert len(prompts) == 3
    with pytest.raises(ValueError, match="no document has 100000 tokens"):
        long_form_prompts(path, 1, 100_000, tok, seed=0)


@pytest.mark.parametrize("context_tokens", [512, 3000])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_niah_needle_sits_at_the_requested_depth(tok: Tokenizer, haystack: str, context_tokens: int,
                                                 depth: float):
    case = niah_case(tok, haystack, context_tokens=context_tokens, depth=depth, seed=7)
    n = len(tok.encode(case.prompt))
    assert n == case.context_tokens
    assert context_tokens * 0.99 - 8 <= n <= context_tokens
    assert case.prompt.count(case.needle_value) == 1
    before = len(tok.encode(case.prompt[:case.prompt.index(case.needle)]))
    realized = before / n
    assert abs(realized - depth) < 0.05 if depth < 1.0 else n - before < 40
    assert case.prompt.endswith("? It is")


def test_niah_is_seeded(tok: Tokenizer, haystack: str):
    a = niah_case(tok, haystack, context_tokens=600, depth=0.5, seed=1)
    assert niah_case(tok, haystack, context_tokens=600, depth=0.5, seed=1) == a
    grid = niah_grid(tok, haystack, context_lengths=[300, 600], depths=[0.1, 0.9], seed=3)
    assert [(c.context_tokens <= L, c.depth) for c, L in zip(grid, [300, 300, 600, 600])] == \
        [(True, 0.1), (True, 0.9), (True, 0.1), (True, 0.9)]
    assert len({c.needle_value for c in grid}) > 1


def test_score_niah_wants_the_value_as_a_whole_number():
    case = NiahCase(prompt="The secret code of Ada Xu is 12345.\nWhat is it? It is", needle_value="12345",
                    depth=0.0, context_tokens=20, needle="The secret code of Ada Xu is 12345.\n")
    assert score_niah(case, " 12345.")
    assert score_niah(case, "the code: 12345")
    assert not score_niah(case, " 123456.")
    assert not score_niah(case, " 54321.")
    assert not score_niah(case, "")


def test_niah_rejects_impossible_requests(tok: Tokenizer, haystack: str):
    with pytest.raises(ValueError, match="no room"):
        niah_case(tok, haystack, context_tokens=20, depth=0.5, seed=0)
    with pytest.raises(ValueError, match="shorter than"):
        niah_case(tok, "short text\n", context_tokens=400, depth=0.5, seed=0)
    with pytest.raises(ValueError, match="depth"):
        niah_case(tok, haystack, context_tokens=400, depth=1.5, seed=0)


def test_haystack_text_is_real_text_of_the_requested_size(held_out):
    text = haystack_text(10_000)
    assert len(text) == 10_000 and "def " in text
    path, docs = held_out
    assert haystack_text(5_000, path) == "\n".join(docs)[:5_000]
