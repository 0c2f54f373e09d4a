"""Running a typer app as a command: one clear line per error, exit status 2, no traceback."""

from __future__ import annotations

from typing import Sequence

import typer
from rich.console import Console
from rich.markup import escape

from engine.errors import EngineError


def _usage_error_types() -> tuple[type[BaseException], ...]:
    """click's usage errors, and the copies of them that recent typer versions carry."""
    import click

    return (click.ClickException, typer.TyperException)


def run_app(app: typer.Typer, argv: Sequence[str] | None) -> int:
    """Exit status of ``app`` on ``argv``: 0, 2 for bad input (engine errors, usage errors), 130 on abort."""
    try:
        app(args=None if argv is None else list(argv), standalone_mode=False)
    except EngineError as exc:
        Console(stderr=True).print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        Console(stderr=True).print("aborted")
        return 130
    except SystemExit as exc:
        return int(exc.code or 0)
    except _usage_error_types() as exc:  # standalone_mode=False hands usage errors to the caller
        show = getattr(exc, "show", None)
        if show is None:
            raise
        show()
        return int(getattr(exc, "exit_code", 2) or 2)
    return 0
