"""The client is only a client: the client's distribution alone runs the SDK and the client commands.

The SDK, `stagediff --help`, `health`, `info` and `generate` load neither torch nor any server package; every
module they import is installed by the plain install (or, like opentelemetry, used only where it is installed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.client_only import REPOSITORY, SERVER_COMMAND_MODULES, SERVER_PACKAGES, client_only_environment


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_client_environment_cannot_import_torch(tmp_path: Path) -> None:
    """The environment the other tests use really lacks the server packages."""
    env = client_only_environment(tmp_path)
    for module in ("torch", "services.tracing", "opentelemetry.trace"):
        result = _run(["-c", f"import {module}"], env)
        assert result.returncode == 1 and "ModuleNotFoundError" in result.stderr, module


def test_the_sdk_and_the_client_commands_load_no_server_module() -> None:
    """In this environment every package is installed: what the client loads is what it imports."""
    script = """
import contextlib, io, json, sys

import stagediff.client, stagediff.client_cli
from stagediff.cli import main

with contextlib.redirect_stdout(io.StringIO()) as help_text:
    try:
        main(["--help"])
    except SystemExit as exit:
        help_code = exit.code
with contextlib.redirect_stdout(io.StringIO()) as health_text:
    health_code = main(["health", "--endpoint", "127.0.0.1:1"])
print(json.dumps({
    "help": [help_code, help_text.getvalue()],
    "health": [health_code, health_text.getvalue()],
    "modules": sorted(sys.modules),
}))
"""
    result = _run(["-c", script])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["help"][0] == 0 and "generate" in report["help"][1] and "init-model" in report["help"][1]
    assert report["health"][0] == 1 and report["health"][1].startswith("UNREACHABLE UNAVAILABLE")
    loaded = sorted({name.partition(".")[0] for name in report["modules"]} & set(SERVER_PACKAGES))
    assert loaded == [], f"the client loaded server packages: {loaded}"
    assert not [name for name in report["modules"] if name.startswith(SERVER_COMMAND_MODULES)]


def test_the_client_commands_run_without_the_server_packages(tmp_path: Path) -> None:
    env = client_only_environment(tmp_path)
    help_run = _run(["-m", "stagediff.cli", "--help"], env)
    assert help_run.returncode == 0 and "generate" in help_run.stdout, help_run.stderr
    health = _run(["-m", "stagediff.cli", "health", "--endpoint", "127.0.0.1:1"], env)
    assert health.returncode == 1 and health.stdout.startswith("UNREACHABLE UNAVAILABLE")
    assert "Traceback" not in health.stderr, health.stderr
    script = "from stagediff import Client; from stagediff._tracing import trace_context_interceptors as t; print(t())"
    sdk = _run(["-c", script], env)
    assert sdk.returncode == 0 and sdk.stdout.strip() == "[]", sdk.stderr


def test_up_help_reads_the_same_without_the_servers(tmp_path: Path) -> None:
    env = client_only_environment(tmp_path)
    without = _run(["-m", "stagediff.cli", "up", "--help"], env)
    assert without.returncode == 0, without.stderr
    assert "--ulysses-degree" in without.stdout and "(default: 50051" in without.stdout
    with_servers = _run(["-m", "stagediff.cli", "up", "--help"])
    assert with_servers.returncode == 0 and with_servers.stdout == without.stdout


def test_a_server_command_without_the_servers_installed_says_in_one_line_how_to_install_them(tmp_path: Path) -> None:
    env = client_only_environment(tmp_path)
    for command in (["up", "--model", "m"], ["serve", "dit", "--help"], ["init-model", "--help"]):
        result = _run(["-m", "stagediff.cli", *command], env)
        assert result.returncode == 2, (command, result.stderr)
        assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, (command, result.stderr)
        assert "pip install . ./server" in result.stderr and "pip install dist/*.whl" in result.stderr, command
    mistaken = _run(["-m", "stagediff.cli", "up", "--model", "m", "--port", "many"], env)
    assert mistaken.returncode == 2 and "argument --port: invalid int value: 'many'" in mistaken.stderr
