"""The client is only a client: its distribution alone (`pip install .`) runs the SDK and the client commands.

The SDK, `stagediff --help`, `health`, `info` and `generate` load neither torch nor any server package; every
module they import is installed by the plain install (or, like opentelemetry, used only where it is installed).
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from stagediff import cli
from tests.helpers.client_only import REPOSITORY, SERVER_COMMAND_MODULES, SERVER_PACKAGES

# The modules a plain install runs from: the SDK and the command line (whose commands, in client_commands, are
# imported when one runs).
CLIENT_ENTRY_MODULES = (
    "stagediff",
    "stagediff.client",
    "stagediff.client_cli",
    "stagediff.client_commands",
    "stagediff.cli",
    "stagediff.media",
    "stagediff.up_options",
)


def _installed_by_the_plain_install() -> set[str]:
    """Distributions `pip install stagediff` installs: the base dependencies and, transitively, theirs."""
    pyproject = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())
    pending = [Requirement(text).name for text in pyproject["project"]["dependencies"]]
    installed: set[str] = set()
    while pending:
        name = canonicalize_name(pending.pop())
        if name in installed:
            continue
        installed.add(name)
        for text in importlib.metadata.requires(name) or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return installed


def _module_file(module: str) -> Path | None:
    base = REPOSITORY.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


class _Imports(ast.NodeVisitor):
    """Every import of a module: (module name, line, the top-level function or class it is in (None: module
    level), guarded by `except ImportError`)."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.found: list[tuple[str, int, str | None, bool]] = []
        self._within: list[str] = []
        self._guarded = 0

    def _nested(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self._within.append(node.name)
        self.generic_visit(node)
        self._within.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _nested

    def visit_Try(self, node: ast.Try) -> None:
        names = {
            name.id if isinstance(name, ast.Name) else getattr(name, "attr", "")
            for handler in node.handlers
            if handler.type is not None
            for name in (handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type])
        }
        guarded = bool(names & {"ImportError", "ModuleNotFoundError"})
        self._guarded += guarded
        for statement in node.body:
            self.visit(statement)
        self._guarded -= guarded
        for statement in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(statement)

    def _add(self, name: str, node: ast.AST) -> None:
        self.found.append((name, node.lineno, self._within[0] if self._within else None, self._guarded > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        assert node.level == 0, f"{self.module}:{node.lineno}: relative import"
        for alias in node.names:  # `from stagediff import client` imports the module stagediff.client
            submodule = f"{node.module}.{alias.name}"
            self._add(submodule if _module_file(submodule) else node.module, node)


def test_every_module_the_client_imports_comes_with_the_plain_install() -> None:
    """The client's modules (those the SDK and the CLI import at module level, followed through stagediff) import
    nothing from the servers, even inside functions, and no package the plain install lacks unless they handle its
    absence. The server commands' modules are imported only inside the CLI functions that run them."""
    server_command_handlers = {("stagediff.cli", handler.__name__) for _, handler in cli.SERVER_COMMANDS.values()}
    installed = _installed_by_the_plain_install()
    distributions = importlib.metadata.packages_distributions()
    first_party = {path.parent.name for path in REPOSITORY.glob("*/__init__.py")}
    problems: list[str] = []
    seen: set[str] = set()
    pending = list(CLIENT_ENTRY_MODULES)
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(module)
        assert path is not None, f"{module}: no such module in the repository"
        visitor = _Imports(module)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        for name, line, within, guarded in visitor.found:
            top = name.partition(".")[0]
            where = f"{path.relative_to(REPOSITORY)}:{line} imports {name}"
            if (module, within) in server_command_handlers:
                continue
            if top == "stagediff":
                if within is None:
                    pending.append(name)
            elif top in first_party or top in SERVER_PACKAGES:
                problems.append(f"{where}, server code")
            elif top in sys.stdlib_module_names or top == "__future__" or guarded:
                continue
            elif not {canonicalize_name(d) for d in distributions.get(top, ())} & installed:
                problems.append(f"{where}, which `pip install stagediff` does not install")
    assert {"stagediff.tensor_codec", "stagediff.status_details", "stagediff.v1.generation_pb2"} <= seen
    assert not [name for name in seen if name.startswith(SERVER_COMMAND_MODULES)]
    assert problems == []
