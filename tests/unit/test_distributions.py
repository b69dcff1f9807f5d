"""The two distributions built from this checkout: the client `stagediff` (pyproject.toml) and the servers
`stagediff-server` (server/pyproject.toml), read as setuptools reads them.

The client holds the `stagediff` package alone (its generated `stagediff.v1` included); every other package of
the tree, `stagediff.local` and the compose files (`stagediff.deploy`) are the servers'. Together they name
every package once. The servers pin the client at their own version. The acceptance of a real build (what pip
puts into site-packages) is tests/integration/test_install_processes.py's.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import stagediff

REPOSITORY = Path(__file__).resolve().parents[2]
CLIENT = REPOSITORY / "pyproject.toml"
SERVERS = REPOSITORY / "server" / "pyproject.toml"
DEPLOY = REPOSITORY / "deploy"
SHAPEWORLD = REPOSITORY / "shapeworld"


def _read(project: Path) -> dict[str, Any]:
    return tomllib.loads(project.read_text())


def _tree_packages() -> set[str]:
    """Every regular package under the repository's root, tests aside."""
    return {
        ".".join(init.parent.relative_to(REPOSITORY).parts)
        for top in REPOSITORY.iterdir()
        if (top / "__init__.py").is_file() and top.name != "tests"
        for init in top.rglob("__init__.py")
    }


def test_the_client_is_the_stagediff_package_alone() -> None:
    client = _read(CLIENT)
    assert client["project"]["name"] == "stagediff"
    assert client["tool"]["setuptools"]["packages"] == ["stagediff", "stagediff.v1"]
    assert "package-dir" not in client["tool"]["setuptools"] and "package-data" not in client["tool"]["setuptools"]
    assert client["project"]["scripts"] == {"stagediff": "stagediff.cli:main"}
    # No extra installs the servers: `stagediff[server]` would resolve the servers' name from an index.
    assert "optional-dependencies" not in client["project"]


def test_the_two_distributions_name_every_package_once() -> None:
    client = _read(CLIENT)["tool"]["setuptools"]["packages"]
    servers = _read(SERVERS)["tool"]["setuptools"]["packages"]
    assert not set(client) & set(servers)
    assert sorted([*client, *servers]) == sorted([*_tree_packages(), "stagediff.deploy"])


def test_the_servers_take_their_packages_from_the_root_and_ship_the_compose_files_and_the_demo_model() -> None:
    setuptools = _read(SERVERS)["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"": "..", "stagediff.deploy": "../deploy"}
    data = setuptools["package-data"]
    shipped = {path for pattern in data["stagediff.deploy"] for path in DEPLOY.glob(pattern)}
    assert shipped == {*DEPLOY.glob("*.yml"), *DEPLOY.glob("env/*.env")}
    demo_files = {path for folder in ("checkpoint", "adapters") for path in (SHAPEWORLD / folder).rglob("*")}
    shipped = {path for pattern in data["shapeworld"] for path in SHAPEWORLD.glob(pattern)}
    assert shipped == demo_files


def test_the_servers_pin_the_client_at_their_own_version() -> None:
    client, servers = _read(CLIENT)["project"], _read(SERVERS)["project"]
    assert servers["name"] == "stagediff-server"
    assert client["version"] == servers["version"] == stagediff.__version__
    assert f"stagediff=={client['version']}" in servers["dependencies"]
    assert "dev" in servers["optional-dependencies"]


def test_no_install_hint_names_an_extra_that_does_not_exist() -> None:
    """What a user reads (the README, docs/, the product's messages) says how to install the servers as they are
    built here, never with an extra of the client."""
    readable = [
        REPOSITORY / "README.md",
        *(REPOSITORY / "docs").glob("*.md"),
        *(path for top in ("stagediff", "services") for path in (REPOSITORY / top).rglob("*.py")),
    ]
    naming = [str(path.relative_to(REPOSITORY)) for path in readable if "stagediff[" in path.read_text()]
    assert naming == []


def _folders() -> dict[str, Path]:
    """Every package of the two distributions -> its folder in the tree."""
    folders = {}
    for project in (CLIENT, SERVERS):
        setuptools = _read(project)["tool"]["setuptools"]
        mapped = setuptools.get("package-dir", {})
        for package in setuptools["packages"]:
            folder = mapped.get(package) or f"{mapped.get('', '.')}/{package.replace('.', '/')}"
            folders[package] = (project.parent / folder).resolve()
    return folders


def test_every_file_of_a_package_folder_ships_as_a_module_or_as_package_data() -> None:
    """A file that is not Python, in a package's folder (or a data folder below it), is named by the package's
    package-data, or an installed wheel would lack it. (deploy/, the folder of `stagediff.deploy`, ships a
    selection: its compose and env files, checked above.)"""
    folders = _folders()
    data = {
        **_read(CLIENT)["tool"]["setuptools"].get("package-data", {}),
        **_read(SERVERS)["tool"]["setuptools"]["package-data"],
    }
    unshipped = []
    for package, folder in folders.items():
        if package == "stagediff.deploy":
            continue
        others = [other for other in folders.values() if other != folder and other.is_relative_to(folder)]
        shipped = {path for pattern in data.get(package, []) for path in folder.glob(pattern)}
        for path in folder.rglob("*"):
            if any(path.is_relative_to(other) for other in others) or "__pycache__" in path.parts:
                continue
            if path.is_file() and path.suffix not in (".py", ".pyi", ".pyc") and path not in shipped:
                unshipped.append(str(path.relative_to(REPOSITORY)))
    assert unshipped == []
