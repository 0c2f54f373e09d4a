"""The tuning service's commands of `luce-tune`: run, status, export, boot."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tuner.config import ApplianceConfig, ConfigError, load_config


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("status")(status)
    app.command("export")(export)
    app.command("boot")(boot)


ConfigOption = typer.Option(None, "--config", "-c",
                            help="appliance config (default: the embedded appliance.toml)")
StorageOption = typer.Option(None, "--storage", help="database URL, overriding study.storage")


def _config(path: Path | None, storage: str | None = None, **study: object) -> ApplianceConfig:
    cfg = load_config(path)
    changes = {k: v for k, v in study.items() if v is not None}
    if storage is not None:
        changes["storage"] = storage
    return cfg.with_study(**changes) if changes else cfg


def _quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(logging.WARNING)


def run(config: Optional[Path] = ConfigOption,
        trials: Optional[int] = typer.Option(None, "--trials", "-n", help="finished trials the study should hold"),
        timeout: Optional[float] = typer.Option(None, "--timeout", help="wall-clock limit of this run in seconds"),
        storage: Optional[str] = StorageOption) -> None:
    """Tune the appliance: run the study (resuming it), then publish the winner's profile."""
    from tuner.progress import LiveProgress, outcome_table
    from tuner.study import Tuner, hang_from_env

    cfg = _config(config, storage, trials=trials, timeout_s=timeout)
    _quiet_optuna()
    console = Console()
    with LiveProgress(console, cfg.objectives.metrics) as progress:
        result = Tuner(cfg, observer=progress, hang=hang_from_env()).run()
    if result.outcomes:
        console.print(outcome_table(result.outcomes, cfg.objectives.metrics,
                                    [result.winner.number] if result.winner else []))
    else:
        console.print(f"study {result.study!r} already holds its trials: nothing to run", markup=False)
    if result.winner is not None:
        w = result.winner
        console.print(f"winner: trial #{w.number} ({w.params.label()}): "
                      f"{w.metrics.decode_tok_s.median:.2f} tok/s "
                      f"[{w.metrics.decode_tok_s.low:.2f}, {w.metrics.decode_tok_s.high:.2f}], "
                      f"TTFT {w.metrics.ttft_s.median * 1000:.1f} ms",
                      highlight=False, soft_wrap=True, markup=False)
        console.print(f"profile: {result.profile}", highlight=False, soft_wrap=True, markup=False)
    else:
        console.print("no feasible trial: no profile was published")


def status(config: Optional[Path] = ConfigOption, storage: Optional[str] = StorageOption,
           study: Optional[str] = typer.Option(None, "--study", help="study name, overriding study.name")) -> None:
    """Show a study: trial counts, the Pareto front, failures and published profiles."""
    from storage.database import StorageError
    from storage.repository import Reader

    cfg = _config(config, storage, name=study)
    name = cfg.study.name
    try:
        reader = Reader.open(cfg.study.storage)
        record = reader.study(name)
    except StorageError as exc:
        raise ConfigError(f"{cfg.source}: study.storage: {exc}") from None
    if record is None:
        raise ConfigError(f"no study {name!r} in {reader.db.display_url}")
    trials = reader.trials(name)
    console = Console()
    counts = {}
    for t in trials:
        counts[t.state] = counts.get(t.state, 0) + 1
    console.print(f"study [bold]{escape(name)}[/bold]: "
                  + ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())))
    names = record.objective_names or tuple(d.lower() for d in record.directions)
    front = Table(title="Pareto front (feasible)", title_justify="left")
    for col in ("#", "parameters", *names, "constraints"):
        front.add_column(col)
    for t in reader.pareto_front(name):
        front.add_row(str(t.number), Text(_params(t.params)), *[f"{v:.4g}" for v in t.values],
                      Text(", ".join(f"{k} {v:g}" for k, v in t.constraints.items())))
    console.print(front)
    failures = [t for t in trials if t.state == "FAIL" or (t.state == "COMPLETE" and not t.feasible)]
    if failures:
        table = Table(title="failed or infeasible", title_justify="left")
        for col in ("#", "parameters", "why"):
            table.add_column(col)
        for t in failures:
            why = t.user_attrs.get("failure") or ", ".join(
                f"{k} +{v:g}" for k, v in t.constraints.items() if v > 0) or "run interrupted"
            table.add_row(str(t.number), Text(_params(t.params)), Text(why))
        console.print(table)
    for p in reader.profiles(name):
        console.print(f"profile of trial #{p.trial_number}: {p.path} ({p.created:%Y-%m-%d %H:%M} UTC)",
                      highlight=False, soft_wrap=True, markup=False)


def _params(params: dict) -> str:
    if not params:
        return "engine defaults"
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def export(trial: int = typer.Option(..., "--trial", "-t", help="trial number to publish"),
           config: Optional[Path] = ConfigOption, storage: Optional[str] = StorageOption,
           out: Optional[Path] = typer.Option(None, "--out", "-o", help="profile path (default: publish.profile)")) -> None:
    """Publish a chosen trial as a profile, from its recorded measurements."""
    from tuner.publish import export_trial

    cfg = _config(config, storage)
    _quiet_optuna()
    path = export_trial(cfg, trial, out or cfg.publish.profile)
    Console().print(f"profile of trial #{trial}: {path}", highlight=False, soft_wrap=True, markup=False)


def boot(profile: Path = typer.Option(..., "--profile", "-p", help="profile written by run or export"),
         config: Optional[Path] = ConfigOption) -> None:
    """Boot the engine from a profile (verified against this machine and the model files),
    falling back to the config's target with default settings when it does not hold."""
    from engine.boot import boot as boot_engine

    cfg = load_config(config)
    err = Console(stderr=True)
    result = boot_engine(profile, fallback_target=cfg.models.target, fallback_device=cfg.hardware.device)
    if result.fell_back:
        err.print(f"[yellow]warning:[/yellow] profile {escape(str(profile))} not used, booted the "
                  f"safe default ({escape(cfg.models.target.name)}, engine defaults):",
                  highlight=False, soft_wrap=True)
        for problem in result.problems:
            err.print(f"  - {problem}", highlight=False, soft_wrap=True, markup=False)
    else:
        settings = ", ".join(f"{k}={v}" for k, v in result.profile.engine.items())
        err.print(f"booted from {profile}: trial #{result.profile.trial} of study "
                  f"{result.profile.study!r} ({settings})",
                  highlight=False, soft_wrap=True, markup=False)
    Console().print(f"smoke generation: {result.smoke_text!r} at {result.smoke_tok_s:.1f} tok/s",
                    highlight=False, soft_wrap=True, markup=False)
