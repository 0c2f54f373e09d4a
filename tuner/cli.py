"""The ``luce-tune`` command: engine commands plus the tuning service's commands."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from dashboard import command as dashboard_command
from engine import cli as engine_cli
from engine.dflash import cli as dflash_cli
from engine.train import cli as train_cli
from tuner import commands
from engine.errors import EngineError


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
    app = build_app()
    try:
        app(args=argv, standalone_mode=False)
    except EngineError as exc:
        Console(stderr=True).print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        Console(stderr=True).print("aborted")
        return 130
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # click's usage errors arrive here in non-standalone mode
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
