"""What pip builds from a checkout: the client alone from the root, the servers from server/.

The checkout is copied (tracked files and the like, not build outputs) and built as a user's `pip install .`
builds it, offline (no index, the installed setuptools). The client's site-packages holds the `stagediff` package
and nothing else: no server package, no model file. Its `stagediff --help` and `stagediff up --help` run there,
in a fresh interpreter whose only other packages are the client's dependencies (the server packages are refused
by tests/helpers/client_only.py's finder), and load neither gRPC, numpy, PyAV nor protobuf: both stay quick.
The servers' wheel holds every server package, the compose files and the demo checkpoint, and pins the client.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers.client_only import NOT_INSTALLED_FINDER, SERVER_COMMAND_MODULES, SERVER_PACKAGES

REPOSITORY = Path(__file__).resolve().parents[2]
# Not part of a fresh clone: build outputs, environments, caches (the component identities `make demo` caches beside
# the demo model's files included), local models.
NOT_IN_A_CLONE = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "build",
    "dist",
    "models",
    "out",
    "__pycache__",
    "*.egg-info",
    ".*_cache",
    ".stagediff-identity.json",
)
# What `--help` must not load: the client's heavy dependencies, used only once a command runs.
HEAVY = ("grpc", "numpy", "av", "PIL", "google.protobuf", "rich", "torch", "yaml")


def _pip(*args: str | Path) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


def _link_or_copy(source: str, target: str) -> None:
    """A hard link where the file system allows one (the build only adds files), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    clone = tmp_path_factory.mktemp("clone") / "stagediff"
    return Path(shutil.copytree(REPOSITORY, clone, ignore=NOT_IN_A_CLONE, copy_function=_link_or_copy))


@pytest.fixture(scope="module")
def client_python(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fresh venv with the client installed from the checkout, offline, no extras: (its python, its
    site-packages). Its dependencies come from this environment's site-packages, the servers' refused."""
    environment = tmp_path_factory.mktemp("client") / "venv"
    venv.EnvBuilder(with_pip=False).create(environment)
    python = environment / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    site = Path(purelib.stdout.strip())
    _pip("install", "--no-deps", "--no-build-isolation", "--no-index", "--target", site, checkout)
    return python, site


def _add_dependencies(site: Path) -> None:
    """The client's dependencies from this environment (its site-packages on the path, its .pth files unread:
    no editable install of the checkout), every server package refused."""
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    refused = sorted({*SERVER_PACKAGES, *SERVER_COMMAND_MODULES, "opentelemetry"})
    (site / "sitecustomize.py").write_text(NOT_INSTALLED_FINDER.format(names=refused))


def _run(python: Path, args: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run([python, *args], cwd=cwd, env=environment, capture_output=True, text=True, timeout=120)


def test_the_client_installs_the_stagediff_package_alone(client_python: tuple[Path, Path], tmp_path: Path) -> None:
    python, site = client_python
    assert sorted(path.name for path in site.iterdir()) == ["bin", "stagediff", "stagediff-0.1.0.dist-info"]
    packages = sorted(path.name for path in (site / "stagediff").iterdir() if path.is_dir())
    assert [name for name in packages if name != "__pycache__"] == ["v1"], "no stagediff.local, no stagediff.deploy"
    files = [path for path in (site / "stagediff").rglob("*") if path.is_file()]
    assert [path.name for path in files if path.suffix not in (".py", ".pyi", ".pyc")] == [], "no model, no data"
    assert sum(path.stat().st_size for path in files) < 2_000_000, "the client holds code, not models"
    assert (site / "bin" / "stagediff").is_file(), "the console script"
    _add_dependencies(site)
    imported = _run(python, ["-c", "import stagediff.client; print(stagediff.client.__file__)"], tmp_path)
    assert imported.returncode == 0 and imported.stdout.startswith(str(site)), imported.stderr


@pytest.mark.parametrize("command", [["--help"], ["up", "--help"]], ids=" ".join)
def test_help_runs_from_the_client_install_without_loading_its_heavy_dependencies(
    client_python: tuple[Path, Path], tmp_path: Path, command: list[str]
) -> None:
    python, site = client_python
    _add_dependencies(site)
    started = time.perf_counter()
    result = _run(python, [site / "bin" / "stagediff", *command], tmp_path)
    print(f"stagediff {' '.join(command)} from the client install: {time.perf_counter() - started:.3f} s wall")
    assert result.returncode == 0, result.stderr
    assert ("generate" if command == ["--help"] else "--ulysses-degree") in result.stdout
    traced = _run(python, ["-X", "importtime", site / "bin" / "stagediff", *command], tmp_path)
    loaded = {line.rpartition("|")[2].strip() for line in traced.stderr.splitlines() if line.startswith("import")}
    assert "stagediff.cli" in loaded, traced.stderr[-2000:]
    assert sorted(loaded & set(HEAVY)) == [], f"stagediff {' '.join(command)} loads what only commands need"


def test_the_servers_wheel_holds_every_server_package_and_the_demo_model(checkout: Path, tmp_path: Path) -> None:
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir", tmp_path, checkout / "server")
    (wheel,) = tmp_path.glob("stagediff_server-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(name for name in names if name.endswith(".dist-info/METADATA"))).decode()
    packages = tomllib.loads((checkout / "server" / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    tops = {name.partition("/")[0] for name in names if not name.startswith("stagediff_server-")}
    assert tops == {package.partition(".")[0] for package in packages}
    assert "stagediff/__init__.py" not in names, "the client's package is the client's"
    assert {"stagediff/local/up.py", "stagediff/deploy/docker-compose.cpu.yml", "stagediff/deploy/env/cpu.env"} <= names
    checkpoint = checkout / "shapeworld" / "checkpoint"
    demo = {f"shapeworld/{path.relative_to(checkpoint.parent)}" for path in checkpoint.rglob("*") if path.is_file()}
    assert demo and demo <= names
    assert "Requires-Dist: stagediff==0.1.0" in metadata.splitlines()


def test_make_demo_installs_the_servers_without_the_development_tools() -> None:
    """`make demo` on a fresh checkout (every target remade: -B; printed, not run: -n) installs torch, the client
    and the servers, and none of the test tools of `./server[dev]`; `make venv` adds them."""
    demo = subprocess.run(["make", "-n", "-B", "demo"], cwd=REPOSITORY, capture_output=True, text=True, check=True)
    installs = [line for line in demo.stdout.splitlines() if " install " in line]
    assert installs == [".venv/bin/pip install torch==2.13.0", ".venv/bin/pip install -e . -e ./server"], installs
    venv_target = subprocess.run(["make", "-n", "-B", "venv"], cwd=REPOSITORY, capture_output=True, text=True)
    assert ".venv/bin/pip install -e . -e './server[dev]'" in venv_target.stdout.splitlines()
