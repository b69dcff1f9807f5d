"""The product packages form layers: a package never imports, directly or through others, a package that
imports it back.

Read from the source with `ast` (nothing is imported), counting every import, inside functions too. The stage
runtimes and services/ (checkpoints, the orchestrator's chains) load families through the registry; families
build on stagekit/ (the stage protocols, errors, weight loading), which imports none of them. The
client's own closure (no server package, nothing the plain install lacks) is
tests/integration/test_client_only_processes.py's; here the CLI's server commands and stagediff/local/ count as
one node apart from the client.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]

PACKAGES = (
    "stagediff",
    "services",
    "families",
    "stagekit",
    "dit_svc",
    "text_encoder_svc",
    "vae_svc",
    "interp_svc",
    "shapeworld",
    "tools",
)
# stagediff/local/ and the bodies of the CLI's SERVER_COMMANDS handlers: server code the client never loads.
SERVER_COMMANDS = "stagediff[server commands]"
STAGE_PACKAGES = ("dit_svc", "text_encoder_svc", "vae_svc", "interp_svc")
# What stagekit may never import: the packages built on it.
ABOVE_STAGEKIT = ("services", "families", *STAGE_PACKAGES, "tools", SERVER_COMMANDS)

Edges = dict[tuple[str, str], list[str]]


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPOSITORY).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _node(module: str) -> str | None:
    if module == "stagediff.local" or module.startswith("stagediff.local."):
        return SERVER_COMMANDS
    top = module.partition(".")[0]
    return top if top in PACKAGES else None


def _server_command_handlers(tree: ast.Module) -> set[str]:
    """The functions named in stagediff/cli.py's SERVER_COMMANDS table."""
    for statement in tree.body:
        target = statement.target if isinstance(statement, ast.AnnAssign) else None
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
        if isinstance(target, ast.Name) and target.id == "SERVER_COMMANDS" and statement.value is not None:
            return {node.id for node in ast.walk(statement.value) if isinstance(node, ast.Name)}
    raise AssertionError("stagediff/cli.py: no SERVER_COMMANDS table")


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _imports_in(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    return [
        (name, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in _imported(node, module, is_package)
    ]


def package_edges() -> Edges:
    """(importer, imported) -> the import sites, "path:line", between distinct nodes."""
    edges: Edges = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((REPOSITORY / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            module = _module_name(path)
            tree = ast.parse(path.read_text(), str(path))
            found = [(module, name, line) for name, line in _imports_in(tree, module, path.name == "__init__.py")]
            if module == "stagediff.cli":
                handlers = _server_command_handlers(tree)
                for function in tree.body:
                    if isinstance(function, ast.FunctionDef) and function.name in handlers:
                        inner = {(name, line) for name, line in _imports_in(function, module, False)}
                        found = [
                            (m, n, line) if (n, line) not in inner else (SERVER_COMMANDS, n, line)
                            for m, n, line in found
                        ]
            for importer, name, line in found:
                source = _node(importer) if importer != SERVER_COMMANDS else SERVER_COMMANDS
                target = _node(name)
                if source and target and source != target:
                    site = f"{path.relative_to(REPOSITORY)}:{line}"
                    if site not in edges[(source, target)]:
                        edges[(source, target)].append(site)
    return dict(edges)


def find_cycle(edges: Edges) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    graph: dict[str, list[str]] = defaultdict(list)
    for source, target in sorted(edges):
        graph[source].append(target)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for successor in graph[node]:
            if state.get(successor) == 1:
                return [*path[path.index(successor) :], successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _describe(cycle: list[str], edges: Edges) -> str:
    steps = [f"{a} -> {b} ({', '.join(edges[(a, b)][:3])})" for a, b in pairwise(cycle)]
    return "import cycle " + " -> ".join(cycle) + ":\n  " + "\n  ".join(steps)


def test_the_cycle_finder_names_a_cycle() -> None:
    edges = {("a", "b"): ["a.py:1"], ("b", "c"): ["b.py:2"], ("c", "a"): ["c.py:3"], ("c", "d"): ["c.py:4"]}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({key: sites for key, sites in edges.items() if key != ("c", "a")}) is None


def test_the_cli_server_commands_are_apart_from_the_client() -> None:
    edges = package_edges()
    assert (SERVER_COMMANDS, "families") in edges, "the init-model command imports families"
    assert not [target for source, target in edges if source == "stagediff"], "the client imports server code"


def test_no_package_imports_one_that_imports_it_back() -> None:
    edges = package_edges()
    cycle = find_cycle(edges)
    assert cycle is None, _describe(cycle, edges)


def test_stagekit_imports_nothing_built_on_it() -> None:
    edges = package_edges()
    wrong = {
        f"stagekit -> {target}: {', '.join(edges[('stagekit', target)])}"
        for target in ABOVE_STAGEKIT
        if ("stagekit", target) in edges
    }
    assert not wrong, "\n".join(sorted(wrong))


def test_families_import_no_stage_package_and_no_service() -> None:
    edges = package_edges()
    wrong = [
        f"families -> {target}: {', '.join(edges[('families', target)])}"
        for target in (*STAGE_PACKAGES, "services")
        if ("families", target) in edges
    ]
    assert not wrong, "\n".join(wrong)


# docs/design.md: a module that grows past this many lines has taken on several jobs; split it along them.
MAX_MODULE_LINES = 500


def test_no_product_module_is_over_its_line_limit() -> None:
    long = {
        str(path.relative_to(REPOSITORY)): lines
        for package in PACKAGES
        for path in (REPOSITORY / package).rglob("*.py")
        if "__pycache__" not in path.parts
        and not path.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
        and (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each along its jobs): {long}"
