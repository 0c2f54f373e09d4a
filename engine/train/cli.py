"""The ``luce-tune train`` command: build the shipped family (mounted by ``tuner.cli``).

``python -m engine.train.cli train ...`` runs the same command without the rest of the CLI.
"""

from __future__ import annotations

import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console

from engine.errors import ConfigError
from engine.run_cli import run_app

PRESETS = {"target": ("target",), "drafter": ("drafter",), "both": ("target", "drafter"), "micro": ("micro",)}
LOG_EVERY_S = 15.0


def register(app: typer.Typer) -> None:
    app.command("train")(train)


def main(argv: list[str] | None = None) -> int:
    app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)
    app.callback()(lambda: None)  # a command group, so that "train" is named as in luce-tune
    register(app)
    return run_app(app, argv)


def train(
    out_dir: Path = typer.Option(Path("models"), "--out-dir", help="where the GGUF files and reports go"),
    preset: str = typer.Option("both", "--preset", help="target, drafter, both, or micro (a CPU smoke test)"),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="hard time budget for the whole command"),
    steps: Optional[int] = typer.Option(None, "--steps", help="training steps per model"),
    seed: int = typer.Option(0, "--seed"),
    ckpt_dir: Optional[Path] = typer.Option(None, "--ckpt-dir", help="checkpoints and the tokenized data"),
    resume: bool = typer.Option(False, "--resume", help="continue from the checkpoints in --ckpt-dir"),
    device: str = typer.Option("auto", "--device"),
    ckpt_every: int = typer.Option(100, "--ckpt-every", help="steps between checkpoints"),
    batch_tokens: Optional[int] = typer.Option(None, "--batch-tokens", help="tokens per step (preset default)"),
    lr: Optional[float] = typer.Option(None, "--lr", help="peak learning rate (preset default)"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="sequence length of the first phase"),
    long_seq_len: Optional[int] = typer.Option(None, "--long-seq-len", help="sequence length of the last phase"),
    long_fraction: Optional[float] = typer.Option(None, "--long-fraction",
                                                  help="share of the steps at the long sequence length"),
    n_retrieval: int = typer.Option(4000, "--retrieval-examples", help="synthetic retrieval examples to train on"),
    example_share: Optional[float] = typer.Option(None, "--example-share",
                                                  help="share of training rows that start at a retrieval example"),
    niah_cases: int = typer.Option(24, "--niah-cases",
                                   help="2K-token needle-in-a-haystack cases run on the exported target (0: none)"),
    max_corpus_mb: Optional[float] = typer.Option(None, "--max-corpus-mb", help="cap on library text used"),
    extra_sources: Optional[list[Path]] = typer.Option(
        None, "--extra-sources", help="a folder of more Python sources to train on (repeatable; installed "
                                      "packages, for example); held-out text stays the library's"),
    max_extra_mb: Optional[float] = typer.Option(None, "--max-extra-mb", help="cap on the extra sources' text"),
    tokenizer_from: Optional[Path] = typer.Option(
        None, "--tokenizer-from", help="take the tokenizer of this GGUF (for example models/luce-target.gguf) "
                                       "instead of training one"),
    experts_impl: Optional[str] = typer.Option(
        None, "--experts-impl", help="transformers experts implementation: eager, grouped_mm "
                                     "(default: eager on CUDA, transformers' choice elsewhere)"),
) -> None:
    """Train the shipped qwen35moe family and write luce-<member>.gguf (Q8_0) with JSON reports."""
    from engine.engine import resolve_device
    from engine.train.batches import Curriculum
    from engine.train.data import CorpusSettings, prepare_data
    from engine.train.pipeline import RunSettings, command_line, run_family

    started = time.monotonic()
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r} is not one of {', '.join(PRESETS)}")
    dev = resolve_device(device)
    curriculum = None
    if seq_len is not None or long_seq_len is not None or long_fraction is not None:
        base = Curriculum()
        short = seq_len if seq_len is not None else min(base.short_len, long_seq_len or base.short_len)
        try:
            curriculum = Curriculum(short_len=short, long_len=long_seq_len if long_seq_len is not None
                                    else max(short, base.long_len),
                                    long_fraction=base.long_fraction if long_fraction is None else long_fraction)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    try:
        settings = RunSettings(members=PRESETS[preset], out_dir=out_dir, seed=seed, steps=steps, minutes=minutes,
                               ckpt_dir=ckpt_dir, resume=resume, batch_tokens=batch_tokens, curriculum=curriculum,
                               ckpt_every=ckpt_every, experts_implementation=experts_impl, lr=lr,
                               example_share=example_share, niah_cases=niah_cases,
                               command=command_line())
        for name in settings.members:
            settings.member_config(name)
        corpus = CorpusSettings(seed=seed, n_retrieval=n_retrieval,
                                max_bytes=None if max_corpus_mb is None else int(max_corpus_mb * 1e6),
                                extra_dirs=tuple(str(d) for d in extra_sources or ()),
                                extra_max_bytes=None if max_extra_mb is None else int(max_extra_mb * 1e6),
                                tokenizer_from=None if tokenizer_from is None else str(tokenizer_from))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if resume and not any((ckpt_dir / m / "last.pt").exists() for m in settings.members):
        raise ConfigError(f"--resume: {ckpt_dir} holds no checkpoint of {', '.join(settings.members)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    err = Console(stderr=True)
    with ExitStack() as stack:
        data_dir = ckpt_dir / "data" if ckpt_dir is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        with err.status("building the corpus and tokenizer"):
            try:
                data = prepare_data(data_dir, corpus)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        s = data.stats
        extra = f" ({s['extra_tokens']:,} of them from the extra sources)" if s["extra_tokens"] else ""
        err.print(f"data: {s['train_tokens']:,} training tokens{extra}, {s['heldout_tokens']:,} held-out, "
                  f"{s['retrieval_train_examples']:,} retrieval examples, vocab {s['vocab']} "
                  f"({time.monotonic() - started:.0f} s)")
        on_step = stack.enter_context(_progress(err))
        reports = run_family(settings, data, device=dev, started=started, on_step=on_step,
                             on_status=lambda text: err.print(f"[dim]{text}[/dim]"))
    for r in reports:
        h, t = r["heldout"], r["training"]
        err.print(f"{r['file']}: {r['export']['bytes'] / 1e6:.1f} MB, {t['steps']} steps in "
                  f"{t['train_seconds']:.0f} s, held-out {h['loss']:.3f} nats/token "
                  f"(unigram {h['unigram_loss']:.3f}), top-quarter routing share "
                  f"{min(x['top_quarter_share'] for x in h['routing']):.2f}-"
                  f"{max(x['top_quarter_share'] for x in h['routing']):.2f}")
        if r.get("retrieval"):
            err.print(f"  retrieval exact match {r['retrieval']['exact_match']:.0%} of {r['retrieval']['cases']}")
        for row in (r.get("niah") or {}).get("rows", ()):
            err.print(f"  needle in a haystack at {row['context']} tokens: {row['accuracy']:.0%} of {row['cases']}")
    err.print(f"done in {time.monotonic() - started:.0f} s; card: {out_dir / 'README.md'}")


class _progress:
    """A progress bar per member on a terminal, one log line every LOG_EVERY_S seconds otherwise."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = None
        self.tasks: dict[str, int] = {}
        self.last_log = 0.0

    def __enter__(self) -> Callable:
        if self.console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.fields[planned]}"),
                                     TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
                                     console=self.console)
            self.progress.__enter__()
        return self.update

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def update(self, member: str, info) -> None:
        loss = f"{info.loss:.3f}" if info.loss is not None else "-"
        stats = (f"loss {loss}  {info.tokens_per_s:,.0f} tok/s  lr {info.lr:.2e}  seq {info.seq_len}")
        planned = info.planned_steps if info.planned_steps is not None else "?"
        if self.progress is not None:
            if member not in self.tasks:
                self.tasks[member] = self.progress.add_task(member, total=None, planned="?", stats="")
            self.progress.update(self.tasks[member], completed=info.step, total=info.planned_steps,
                                 planned=planned, stats=stats)
            return
        now = time.monotonic()
        if now - self.last_log >= LOG_EVERY_S or info.step == info.planned_steps:
            self.last_log = now
            self.console.print(f"{member} step {info.step}/{planned}  {stats}", highlight=False)


if __name__ == "__main__":
    sys.exit(main())
