"""`luce-tune dashboard`: serve the Streamlit dashboard on a study database, read-only."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

import typer

from dashboard.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "dashboard" / "app.py"
# The same file as the embedded appliance.toml's default study.storage.
DEFAULT_STORAGE = f"sqlite:///{ROOT / 'runs' / 'luce-tune.db'}"


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard)


def dashboard(
    storage: str = typer.Option(DEFAULT_STORAGE, "--storage", help="study database URL "
                                "(sqlite:///path or postgresql+psycopg://...)"),
    port: int = typer.Option(8501, "--port", min=1, max=65535, help="port to serve on"),
    address: str = typer.Option("127.0.0.1", "--address",
                                help="address to bind; the default serves this machine only"),
    refresh: float = typer.Option(5.0, "--refresh", min=0.0,
                                  help="seconds between live refreshes of the overview; 0 turns them off"),
) -> None:
    """Browse studies, trials, telemetry and profiles in a web dashboard (read-only)."""
    from dashboard.data import READ_ERRORS, Source, describe_error

    if importlib.util.find_spec("streamlit") is None:
        typer.echo("error: the dashboard needs Streamlit, pandas and plotly: "
                   "pip install 'luce-tune[dashboard]'", err=True)
        raise typer.Exit(2)

    try:
        source = Source.open(storage)
        source.studies()
        source.close()
    except READ_ERRORS as exc:
        typer.echo(f"error: {describe_error(exc, storage)}", err=True)
        raise typer.Exit(2) from None
    try:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
            probe.bind((address, port))
    except OSError as exc:
        typer.echo(f"error: cannot serve on {address}:{port}: {exc.strerror}; choose another --port "
                   "or --address", err=True)
        raise typer.Exit(2) from None
    env = dict(os.environ) | Settings(storage=storage, refresh_s=refresh).to_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "streamlit", "run", str(APP),
               "--server.address", address, "--server.port", str(port),
               "--server.headless", "true", "--browser.gatherUsageStats", "false",
               "--server.fileWatcherType", "none", "--global.developmentMode", "false",
               "--client.toolbarMode", "minimal"]
    typer.echo(f"luce-tune dashboard on http://{address}:{port} (reading {source.display_url})")
    sys.stdout.flush()
    # Streamlit replaces this process, so Ctrl-C and kill reach the server itself.
    os.execve(sys.executable, command, env)


def main() -> None:
    """Run the command on its own: ``python -m dashboard.command --storage URL``."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(dashboard)
    app()


if __name__ == "__main__":
    main()
