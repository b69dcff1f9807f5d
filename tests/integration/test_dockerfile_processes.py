"""deploy/Dockerfile, read without a Docker engine: layer order, the dependency list it installs, the user."""

from __future__ import annotations

import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.helpers.dockerfile import REPOSITORY, instructions


def test_the_dependency_layer_installs_exactly_the_projects_dependencies(tmp_path: Path) -> None:
    run = next(args for name, args in instructions() if name == "RUN" and "tomllib" in args)
    script = shlex.split(run)[2]  # python3 -c SCRIPT > /tmp/requirements.txt && ...
    (tmp_path / "server").mkdir()
    for project in ("pyproject.toml", "server/pyproject.toml"):
        (tmp_path / project).write_bytes((REPOSITORY / project).read_bytes())
    printed = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True)
    client = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    servers = tomllib.loads((REPOSITORY / "server" / "pyproject.toml").read_text())["project"]
    # The servers' pin of the client is left out: the client is installed from the source, with the servers.
    expected = client["dependencies"] + [d for d in servers["dependencies"] if d != f"stagediff=={client['version']}"]
    assert printed.stdout.splitlines() == expected
