"""The ``luce-tune`` command: engine commands plus the tuning service's commands."""

from __future__ import annotations

import sys

import typer

from dashboard import command as dashboard_command
from engine import cli as engine_cli
from engine.dflash import cli as dflash_cli
from engine.train import cli as train_cli
from tuner import commands
from engine.run_cli import run_app


def build_app() -> typer.Typer:
    app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                      help="Tune and run qwen35moe inference on this appliance.")
    engine_cli.register(app)
    train_cli.register(app)
    dflash_cli.register(app)
    commands.register(app)
    dashboard_command.register(app)
    return app


def main(argv: list[str] | None = None) -> int:
    return run_app(build_app(), argv)


if __name__ == "__main__":
    sys.exit(main())
