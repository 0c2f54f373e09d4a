"""`luce-tune dashboard`: refuses what it cannot serve with one sentence, and serves the rest."""

import socket

import pytest
import typer
from typer.testing import CliRunner

from dashboard.command import register
from storage.repository import Repository


def app():
    cli = typer.Typer()
    cli.callback()(lambda: None)  # keep `dashboard` a subcommand, as under luce-tune
    register(cli)
    return cli


def test_a_missing_database_exits_2_with_one_sentence(tmp_path):
    result = CliRunner().invoke(app(), ["dashboard", "--storage", f"sqlite:///{tmp_path / 'x.db'}"])
    assert result.exit_code == 2
    assert result.output.strip() == (f"error: storage URL 'sqlite:///{tmp_path / 'x.db'}': database "
                                     f"file {tmp_path / 'x.db'} does not exist")


@pytest.fixture
def empty_db(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    Repository.open(url).optuna_storage()
    return url


def test_a_port_in_use_exits_2(empty_db):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app(), ["dashboard", "--storage", empty_db, "--port", str(port)])
    assert result.exit_code == 2
    assert f"cannot serve on 127.0.0.1:{port}" in result.output


def test_options_and_defaults():
    result = CliRunner().invoke(app(), ["dashboard", "--help"])
    assert result.exit_code == 0
    for option in ("--storage", "--port", "--address", "--refresh"):
        assert option in result.output
    assert "127.0.0.1" in result.output


@pytest.mark.parametrize("port", ["0", "70000"])
def test_a_bad_port_is_a_usage_error(port, empty_db):
    result = CliRunner().invoke(app(), ["dashboard", "--storage", empty_db, "--port", port])
    assert result.exit_code == 2
    assert "--port" in result.output


def test_mounted_in_luce_tune():
    from tuner.cli import build_app

    assert "dashboard" in [c.name for c in build_app().registered_commands]
    result = CliRunner().invoke(build_app(), ["dashboard", "--help"])
    assert result.exit_code == 0 and "--storage" in result.output
