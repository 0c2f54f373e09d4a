"""The concrete prompts of a study, built from the workload config and the target's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tuner.config import WorkloadConfig
from tuner.protocol import Job


@dataclass(frozen=True)
class Workload:
    jobs: tuple[Job, ...]
    niah: Mapping[str, Any] = field(default_factory=dict)  # job key -> workloads.NiahCase

    @property
    def code_jobs(self) -> tuple[Job, ...]:
        return tuple(j for j in self.jobs if j.key.startswith("code/"))

    def score(self, key: str, text: str) -> float:
        """1.0 when the needle of NIAH job ``key`` was retrieved in ``text``."""
        from tuner.workloads import score_niah

        return float(score_niah(self.niah[key], text))


def build_workload(cfg: WorkloadConfig, tokenizer: Any, *, scratch: Path) -> Workload:
    """Code prompts, long-form prompts and needle cases, all seeded by ``cfg.seed``.

    Long prompts come from ``cfg.corpus`` or, without one, from standard-library text
    written once into ``scratch``.
    """
    from tuner import workloads

    n = cfg.max_new_tokens
    jobs = [Job(key=f"code/{p.id}", prompt=p.text, max_new_tokens=n)
            for p in workloads.code_prompts(cfg.code_prompts, cfg.seed)]
    chars = cfg.long_prompt_tokens * 16 * max(1, cfg.long_form_prompts + cfg.niah_cases)
    corpus = cfg.corpus
    if corpus is None and cfg.long_form_prompts:
        corpus = scratch / "stdlib-corpus.txt"
        corpus.write_text(workloads.haystack_text(chars), encoding="utf-8")
    if cfg.long_form_prompts:
        jobs += [Job(key=p.id, prompt=p.text, max_new_tokens=n, long=True)
                 for p in workloads.long_form_prompts(corpus, cfg.long_form_prompts,
                                                      cfg.long_prompt_tokens, tokenizer, cfg.seed)]
    niah = {}
    if cfg.niah_cases:
        hay = workloads.haystack_text(chars, cfg.corpus)
        for i in range(cfg.niah_cases):
            case = workloads.niah_case(tokenizer, hay, context_tokens=cfg.long_prompt_tokens,
                                       depth=(i + 0.5) / cfg.niah_cases, seed=cfg.seed + i)
            key = f"niah/{i}"
            niah[key] = case
            jobs.append(Job(key=key, prompt=case.prompt, max_new_tokens=n, long=True))
    return Workload(jobs=tuple(jobs), niah=niah)
