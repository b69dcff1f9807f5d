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
    (tmp_path / "pyproject.toml").write_bytes((REPOSITORY / "pyproject.toml").read_bytes())
    printed = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True)
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    expected = project["dependencies"] + project["optional-dependencies"]["server"]
    assert printed.stdout.splitlines() == expected
