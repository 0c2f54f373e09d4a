"""Train, measure and export the shipped family under one time budget.

One call builds the data once, then trains each member in turn (target first), measures it
on held-out text and retrieval examples, writes ``luce-<member>.gguf`` with a JSON report
beside it, and renders the model card from the reports.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from engine.train.batches import Curriculum, eval_windows
from engine.errors import ConfigError
from engine.train.data import FamilyData
from engine.train.evaluate import evaluate, evaluate_retrieval, unigram_log_probs
from engine.train.train_target import StepInfo, TrainConfig, preset_config, train

MEMBERS = ("target", "drafter")
# Shares of the training time when members are trained together.
TIME_SHARES = {"target": 0.85, "drafter": 0.15, "micro": 1.0}
REPORT_SUFFIX = ".report.json"
HISTORY_POINTS = 100
NIAH_CONTEXTS = (2048,)  # the target's acceptance: needles found in 2K-token prompts
NIAH_CASES = 24  # per context length, needle depths evenly spread from 0 to 1


@dataclass(frozen=True)
class RunSettings:
    members: tuple[str, ...]
    out_dir: Path
    seed: int = 0
    steps: int | None = None
    minutes: float | None = None  # the whole run: data, training, measures and export
    ckpt_dir: Path | None = None
    resume: bool = False
    ckpt_every: int = 100
    experts_implementation: str | None = None
    lr: float | None = None
    example_share: float | None = None
    batch_tokens: int | None = None
    curriculum: Curriculum | None = None
    eval_tokens: int = 1 << 20
    eval_batch_tokens: int = 65536
    reserve_s: float = 30.0  # per member, for measures and export
    niah_cases: int = NIAH_CASES  # NIAH cases per context for the target (0: none)
    quant: str = "q8_0"
    command: str = ""

    def __post_init__(self) -> None:
        unknown = [m for m in self.members if m not in TIME_SHARES]
        if not self.members or unknown:
            raise ValueError(f"members must be among {sorted(TIME_SHARES)}, got {list(self.members)}")
        if self.steps is None and self.minutes is None:
            raise ValueError("give --steps, --minutes or both")
        if self.resume and self.ckpt_dir is None:
            raise ValueError("--resume needs --ckpt-dir, where the checkpoints are")

    def member_config(self, name: str) -> TrainConfig:
        overrides: dict[str, Any] = {"seed": self.seed, "steps": self.steps, "minutes": self.minutes,
                                     "ckpt_every": self.ckpt_every,
                                     "experts_implementation": self.experts_implementation}
        if self.batch_tokens is not None:
            overrides["batch_tokens"] = self.batch_tokens
        if self.lr is not None:
            overrides["lr"] = self.lr
        if self.example_share is not None:
            overrides["example_share"] = self.example_share
        if self.curriculum is not None:
            overrides["curriculum"] = self.curriculum
        if name == "micro":
            return TrainConfig(shape="micro", **overrides)
        return preset_config(name, **overrides)


def gguf_name(member: str) -> str:
    return f"luce-{member}.gguf"


def run_family(settings: RunSettings, data: FamilyData, *, device: torch.device, started: float,
               on_step: Callable[[str, StepInfo], None] | None = None,
               on_status: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Train every member of ``settings``; returns their reports (also written as JSON)."""
    from engine.train.export import export_gguf
    from engine.train.model_card import write_model_card

    end = started + 60.0 * settings.minutes if settings.minutes is not None else None
    unigram = unigram_log_probs(data.streams.train.ids, data.streams.vocab)
    reports = []
    for i, name in enumerate(settings.members):
        cfg = settings.member_config(name)
        deadline = None
        if end is not None:
            later = settings.members[i:]
            budget = end - time.monotonic() - settings.reserve_s * len(later)
            share = TIME_SHARES[name] / sum(TIME_SHARES[m] for m in later)
            deadline = time.monotonic() + max(0.0, budget) * share
        if on_status:
            on_status(f"training {name}")
        model, result = train(cfg, data.streams, device=device, ckpt_dir=settings.ckpt_dir,
                              resume=settings.resume, deadline=deadline,
                              on_step=(lambda info, name=name: on_step(name, info)) if on_step else None)
        if result.steps == 0:
            raise ConfigError(f"the time budget of {settings.minutes} minutes left no time to train the {name}")
        if on_status:
            on_status(f"measuring {name}")
        heldout, retrieval, eval_len = _measure(model, cfg, data, settings, unigram, device)
        if on_status:
            on_status(f"exporting {name}")
        exported = export_gguf(model, settings.out_dir / gguf_name(name), cfg.model_shape,
                               tokenizer_metadata=data.tokenizer_metadata, quant=settings.quant)
        report = _report(name, cfg, settings, data, result, heldout, retrieval, exported, eval_len)
        if name == "target" and settings.niah_cases and data.heldout_text is not None:
            if on_status:
                on_status("needle in a haystack on the exported target")
            report["niah"] = measure_niah(exported.path, data.heldout_text, device=device,
                                          cases=settings.niah_cases, seed=settings.seed)
        path = settings.out_dir / f"luce-{name}{REPORT_SUFFIX}"
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        reports.append(report)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_model_card(settings.out_dir)
    return reports


def _measure(model, cfg: TrainConfig, data: FamilyData, settings: RunSettings, unigram: torch.Tensor,
             device: torch.device):
    """(held-out loss and routing, retrieval score or None, held-out window length)."""
    autocast = device.type == "cuda"
    eval_len = min(cfg.curriculum.long_len, len(data.streams.heldout) - 1)
    rows = eval_windows(data.streams.heldout, eval_len, settings.eval_tokens)
    heldout = evaluate(model, rows, unigram=unigram, device=device, autocast=autocast,
                       batch_rows=max(1, settings.eval_batch_tokens // eval_len))
    retrieval = evaluate_retrieval(model, data.retrieval_cases, device=device, autocast=autocast,
                                   max_len=cfg.curriculum.long_len)
    return heldout, retrieval, eval_len


def measure_niah(gguf_path, haystack_file: Path, *, device: torch.device, cases: int, seed: int,
                 contexts: tuple[int, ...] = NIAH_CONTEXTS, max_new: int = 8) -> dict[str, Any]:
    """Greedy needle retrieval of the exported file through the engine, haystacks from ``haystack_file``.

    The same cases and scorer the PFlash benchmark uses (``tuner.workloads``), full prefill.
    """
    from engine.engine import Engine
    from tuner.workloads import haystack_text, niah_grid, score_niah

    eng = Engine.from_gguf(gguf_path, device=device)
    text = haystack_text(6 * max(contexts) + 4096, haystack_file)
    depths = [i / (cases - 1) for i in range(cases)] if cases > 1 else [0.5]
    rows = []
    for context in contexts:
        grid = niah_grid(eng.tokenizer, text, context_lengths=[context], depths=depths, seed=seed)
        hits = [score_niah(c, eng.generate(eng.tokenizer.encode(c.prompt), max_new, ignore_eos=True).text)
                for c in grid]
        rows.append({"context": context, "cases": len(hits), "accuracy": sum(hits) / len(hits),
                     "missed_depths": [round(c.depth, 3) for c, h in zip(grid, hits) if not h]})
    del eng
    return {"rows": rows, "haystack": Path(haystack_file).name, "max_new_tokens": max_new}


def _report(name, cfg: TrainConfig, settings: RunSettings, data: FamilyData, result, heldout, retrieval,
            exported, eval_len: int) -> dict[str, Any]:
    shape = cfg.model_shape
    vocab = data.streams.vocab
    history = list(result.loss_history)
    stride = max(1, len(history) // HISTORY_POINTS)
    training = result.as_dict()
    kept = history[::stride] + ([history[-1]] if history and (len(history) - 1) % stride else [])
    training["loss_history"] = [list(p) for p in kept]
    return {
        "member": name,
        "file": Path(exported.path).name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": settings.command,
        "export": exported.as_dict() | {"path": Path(exported.path).name},
        "shape": shape.as_dict(),
        "vocab": vocab,
        "params": shape.param_count(vocab),
        "active_params": shape.active_param_count(vocab),
        "config": cfg.as_dict(),
        "training": training,
        "heldout": heldout.as_dict() | {"seq_len": eval_len},
        "retrieval": retrieval.as_dict() if retrieval is not None else None,
        "data": data.stats,
        "software": _software(),
    }


def _software() -> dict[str, str]:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "platform": platform.platform()}
    try:
        import fla

        out["fla"] = getattr(fla, "__version__", "unknown")
    except ImportError:
        pass
    return out


def command_line() -> str:
    return " ".join(["luce-tune", *sys.argv[1:]])
