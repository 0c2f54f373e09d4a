"""``luce-tune train-draft``: train a DFlash draft for a qwen35moe target (mounted by tuner.cli)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.console import Console

from engine.errors import ConfigError


def register(app: typer.Typer) -> None:
    app.command("train-draft")(train_draft)


def parse_layer_ids(text: str, n_target_layers: int) -> tuple[int, ...]:
    """``"1,4,7"`` -> (1, 4, 7): distinct target layer ids, each below the target's depth."""
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--layer-ids must be comma-separated integers, got {text!r}") from None
    bad = [i for i in ids if not 0 <= i < n_target_layers]
    if bad or len(set(ids)) != len(ids):
        raise ConfigError(f"--layer-ids {text!r}: need distinct ids in 0..{n_target_layers - 1} "
                          f"(the target has {n_target_layers} layers)")
    return ids


def parse_duration(text: str) -> float:
    """``90m``, ``2h``, ``3600s`` or a bare number of minutes -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"time budget {text!r} is not a positive duration such as 90m, 2h or 3600s")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "": 60}[match.group(2)]


def train_draft(
    target: Path = typer.Option(..., "--target", help="qwen35moe GGUF the draft is trained for (kept frozen)"),
    corpus: Path = typer.Option(..., "--corpus", help="a text file (documents split at <|endoftext|>) or a "
                                                       "directory of text files"),
    held_out: Optional[Path] = typer.Option(None, "--held-out", help="text for the acceptance report that the draft "
                                            "does not train on (a file or directory; default: 5% of the corpus's "
                                            "documents); text the target never trained on either shows what new "
                                            "prompts get"),
    init: Optional[Path] = typer.Option(None, "--init", help="start from this draft's weights (a draft GGUF of the "
                                        "same shape) instead of random ones"),
    out: Path = typer.Option(..., "--out", "-o", help="draft GGUF to write; <out>.ckpt and "
                                                      "<out stem>.acceptance.json go beside it"),
    steps: int = typer.Option(2000, "--steps", help="optimizer steps (the learning-rate schedule spans them)"),
    time_budget: Optional[str] = typer.Option(None, "--time-budget", help="stop training after this long "
                                              "(90m, 2h, 3600s; a bare number is minutes), then save and evaluate"),
    seq_len: int = typer.Option(2048, "--seq-len", help="tokens per corpus row (without --distill)"),
    batch: int = typer.Option(1, "--batch", help="sequences per step"),
    anchors: int = typer.Option(64, "--anchors", help="random blocks per sequence (rounded down a little so "
                                                      "they split into equal groups)"),
    lr: float = typer.Option(6e-4, "--lr"),
    layers: int = typer.Option(5, "--layers", help="draft layers"),
    features: int = typer.Option(5, "--features", help="target layers whose outputs feed the draft"),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="the draft's key/value heads (a divisor of its "
                                           "heads; default a quarter of them): each layer reads the context through "
                                           "them"),
    layer_ids: Optional[str] = typer.Option(None, "--layer-ids", help="those target layers by id, comma-separated "
                                            "(for example 1,4,7; overrides --features' evenly spaced choice)"),
    block_size: int = typer.Option(16, "--block-size", help="tokens per drafted block (the largest spec_len)"),
    gamma: Optional[float] = typer.Option(None, "--gamma", help="loss decay over block slots (7 at 16, 4 at 8)"),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id"),
    labels: str = typer.Option("target", "--labels", help="target (the target's greedy choices) or corpus"),
    distill: int = typer.Option(0, "--distill", help="train on N sequences the target generates itself (greedy "
                                "continuations of corpus prompts) instead of corpus windows; 0: off"),
    distill_prompt: int = typer.Option(64, "--distill-prompt", help="corpus tokens before each continuation"),
    distill_new: int = typer.Option(192, "--distill-new", help="tokens the target generates after each prompt; "
                                    "anchors lie among them"),
    distill_batch: int = typer.Option(256, "--distill-batch", help="continuations generated together"),
    seed: int = typer.Option(0, "--seed"),
    weights: str = typer.Option("bf16", "--weights", help="f32, f16, bf16 or q8_0 for the draft's matrices"),
    device: str = typer.Option("auto", "--device"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="the target's compute dtype"),
    restart: bool = typer.Option(False, "--restart", help="start over even if a checkpoint of this run exists"),
    eval_prompts: int = typer.Option(8, "--eval-prompts", help="held-out prompts for the acceptance report"),
    eval_prompt_tokens: int = typer.Option(128, "--eval-prompt-tokens", help="tokens of each held-out prompt "
                                           "(issue 4's table continues prompts of 512)"),
    eval_new_tokens: int = typer.Option(128, "--eval-new-tokens"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Train a DFlash draft for a target, write it as a Lucebox draft GGUF, report held-out acceptance.

    With --distill N the rows are the target's own greedy continuations: N prompts of
    --distill-prompt tokens from the training documents, each continued by --distill-new
    tokens with transformers' Qwen3.5-MoE module loaded from the target GGUF (batches of
    --distill-batch; bf16 on CUDA). They are kept in <out>.distill.pt and reused by a run with
    the same target, corpus and settings. Anchors lie in the generated part, so every block
    learns what the target goes on to generate; each sequence goes through the engine's target
    once, a step's new ones in one batched forward (features and labels are kept on the device:
    N x (P + G) x features x hidden values),
    and the report gives the share of generated tokens the engine's greedy choice agrees with.
    """
    from engine.dflash.train import TrainOptions, new_draft_config, train_draft as run
    from engine.engine import Engine

    try:
        opts = TrainOptions(steps=steps, seq_len=seq_len, batch=batch, anchors=anchors, lr=lr, gamma=gamma,
                            labels=labels, seed=seed, weights=weights, eval_prompts=eval_prompts,
                            eval_prompt_len=eval_prompt_tokens, eval_new_tokens=eval_new_tokens, distill=distill,
                            distill_prompt=distill_prompt,
                            distill_new=distill_new, distill_batch=distill_batch,
                            time_budget_s=parse_duration(time_budget) if time_budget is not None else None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    err = Console(stderr=True)
    eng = Engine.from_gguf(target, device=device, dtype=dtype)
    ids = parse_layer_ids(layer_ids, eng.model.cfg.n_layers) if layer_ids is not None else None
    cfg = new_draft_config(eng.model.cfg, n_layers=layers, n_features=features, block_size=block_size, layer_ids=ids,
                           mask_token_id=mask_token_id, n_head_kv=kv_heads)
    err.print(f"[dim]{target.name}: {eng.model.cfg.n_layers} layers, hidden {eng.model.cfg.hidden}, on {eng.device}; "
              f"draft {cfg.n_layers} layers of {cfg.n_head} heads ({cfg.n_head_kv} key/value) reading target layers "
              f"{list(cfg.target_layer_ids)}, block {cfg.block_size}[/dim]")
    if distill and (epochs := steps * batch / distill) > MANY_EPOCHS:
        err.print(f"[yellow]{steps} steps of {batch} rows over {distill} distilled sequences is {epochs:.0f} epochs: "
                  f"drafts that see their sequences this often learn them rather than the target (held-out "
                  f"acceptance 1.2-1.4 against 6.7 on their own rows, docs/benchmarks.md); more --distill "
                  f"sequences generalize better[/yellow]")
    if distill and (rows := distill_prompt + distill_new) < eval_prompt_tokens + eval_new_tokens:
        err.print(f"[yellow]distilled rows of {rows} tokens are shorter than the evaluation's "
                  f"{eval_prompt_tokens} + {eval_new_tokens}: drafts accept less past the context lengths they "
                  f"trained on (rows of 160 tokens: 1.75 tokens a step after 64-token prompts, 1.10 after 512; "
                  f"docs/benchmarks.md)[/yellow]")
    with _ProgressBar(err, enabled=progress) as bar:
        report = run(eng.model, eng.tokenizer, cfg, corpus, out, opts, target_name=target.name, target_path=target,
                     held_out=held_out, init=init, resume=not restart, progress=bar.stage("train-draft"),
                     distill_progress=bar.stage("distill"))
    held = report.held_out
    if report.distill is not None:
        d = report.distill
        agree = "-" if d["agreement"] is None else f"{d['agreement']:.3f}"
        err.print(f"distilled {d['sequences']} sequences of {d['prompt_len']} + {d['new_tokens']} tokens in "
                  f"{d['generate_s']:.0f} s; engine agrees with the generated tokens at {agree} of "
                  f"{d['target_passes']} sequences' generated positions")
    err.print(f"wrote {out} after {report.steps} steps ({report.train_s:.0f} s, loss {report.final_loss:.3f}); "
              f"held-out acceptance length {held['acceptance_length']:.2f} at spec_len {held['spec_len']} "
              f"over {held['prompts']} prompts of {held['source']} ({out.with_suffix('.acceptance.json')})")


class _ProgressBar:
    """Rich progress bars on a terminal (one per stage, in one live display); elsewhere (logs)
    one line per stage every ``LOG_EVERY_S`` seconds."""

    LOG_EVERY_S = 30.0

    def __init__(self, console: Console, *, enabled: bool) -> None:
        self.console, self.enabled = console, enabled
        self.progress = None
        self.tasks: dict[str, Any] = {}
        self.last_line: dict[str, float] = {}

    def __enter__(self) -> "_ProgressBar":
        if self.enabled and self.console.is_terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"),
                                     console=self.console, transient=False)
            self.progress.__enter__()
        return self

    def stage(self, label: str) -> Callable[[int, int, dict[str, float]], None]:
        """The ``progress(done, total, metrics)`` callback of one stage."""
        return lambda done, total, metrics: self.update(label, done, total, metrics)

    def update(self, label: str, done: int, total: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        text = _metrics_text(metrics)
        if self.progress is None:
            now = time.monotonic()
            if now - self.last_line.get(label, float("-inf")) >= self.LOG_EVERY_S or done == total:
                self.console.print(f"{label} {done}/{total}  {text}", highlight=False)
                self.last_line[label] = now
            return
        if label not in self.tasks:
            self.tasks[label] = self.progress.add_task(label, total=total, completed=done, metrics=text)
        self.progress.update(self.tasks[label], completed=done, metrics=text)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)


MANY_EPOCHS = 4  # distilled epochs past which train-draft warns that the draft will learn its rows
_METRIC_FORMATS = {"loss": "loss {:.3f}", "tf_accept": "accept {:.2f}", "tf_accept_median": "(median row {:.2f})",
                   "agree": "agree {:.3f}", "lr": "lr {:.2e}",
                   "passes": "target passes {:,.0f}", "tok_per_s": "{:,.0f} tok/s"}


def _metrics_text(metrics: dict[str, float]) -> str:
    return "  ".join(_METRIC_FORMATS[k].format(v) for k, v in metrics.items() if k in _METRIC_FORMATS and v == v)
