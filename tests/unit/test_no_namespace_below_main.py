"""No function below a service's `main` takes the parsed options (`argparse.Namespace`).

Each service builds one frozen, checked configuration from its parsed options in `main` (its config class's
`from_options`, or `from_args` where a refusal exits) and hands the parts down. This test parses every
product module and names each function, outside those, with a parameter annotated `Namespace`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

Function = ast.FunctionDef | ast.AsyncFunctionDef
Found = Iterator[tuple[str, Function, ast.ClassDef | None]]

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = (
    "stagediff/local",
    "services",
    "dit_svc",
    "text_encoder_svc",
    "vae_svc",
    "interp_svc",
    "families",
    "stagekit",
)
# Entry points that take the parsed options by name.
ENTRY_POINTS = frozenset({"main"})
# Classmethods of a config class (a class named *Config) that build it from the parsed options.
CONFIG_BUILDERS = frozenset({"from_options", "from_args"})
# Command handlers of the `stagediff` CLI below stagediff/local: each is what stagediff/cli.py dispatches a
# subcommand to with its parsed options, the `main` of that command (path relative to the repository: function).
COMMAND_HANDLERS = {
    "stagediff/local/up.py": frozenset({"run"}),  # `stagediff up` (stagediff/cli.py: _up)
}


def _product_modules() -> Iterator[Path]:
    for package in PRODUCT_PACKAGES:
        directory = ROOT / package
        if directory.is_dir():
            yield from sorted(path for path in directory.rglob("*.py") if "__pycache__" not in path.parts)


def _names_namespace(annotation: ast.expr | None) -> bool:
    """Whether an annotation mentions `Namespace` (`argparse.Namespace`, a bare import, a string, nested)."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Namespace":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Namespace":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "Namespace" in node.value:
            try:
                if _names_namespace(ast.parse(node.value, mode="eval").body):
                    return True
            except SyntaxError:
                continue
    return False


def _is_classmethod(function: Function) -> bool:
    return any(
        isinstance(decorator, ast.Name) and decorator.id == "classmethod" for decorator in function.decorator_list
    )


def _functions(tree: ast.Module) -> Found:
    """Every function, with its dotted name and the class it is a method of (None for others)."""

    def visit(node: ast.AST, prefix: str, owner: ast.ClassDef | None) -> Found:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.", child)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{prefix}{child.name}", child, owner
                yield from visit(child, f"{prefix}{child.name}.", None)
            else:
                yield from visit(child, prefix, owner)

    yield from visit(tree, "", None)


def _allowed(relative: str, name: str, function: Function, owner: ast.ClassDef | None) -> bool:
    if owner is None and name in ENTRY_POINTS:
        return True
    if owner is not None and owner.name.endswith("Config") and function.name in CONFIG_BUILDERS:
        return _is_classmethod(function)
    return owner is None and name in COMMAND_HANDLERS.get(relative, frozenset())


def namespace_parameters() -> list[str]:
    """`file:function (parameter)` for each parameter annotated Namespace outside the allowed functions."""
    found = []
    for path in _product_modules():
        relative = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=relative)
        for name, function, owner in _functions(tree):
            arguments = function.args
            parameters = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            parameters += [parameter for parameter in (arguments.vararg, arguments.kwarg) if parameter is not None]
            for parameter in parameters:
                if _names_namespace(parameter.annotation) and not _allowed(relative, name, function, owner):
                    found.append(f"{relative}:{name} ({parameter.arg})")
    return found


def test_the_check_sees_what_it_looks_for() -> None:
    source = (
        "import argparse\n"
        "def main(args: argparse.Namespace) -> None: ...\n"
        "def helper(args: 'argparse.Namespace') -> None: ...\n"
        "def serve(make: Callable[[Namespace], int]) -> None: ...\n"
        "class StageConfig:\n"
        "    @classmethod\n"
        "    def from_options(cls, args: argparse.Namespace) -> None: ...\n"
        "    def from_args(self, args: argparse.Namespace) -> None: ...\n"
        "class Servicer:\n"
        "    @classmethod\n"
        "    def from_options(cls, args: argparse.Namespace | None) -> None: ...\n"
    )
    found = [
        name
        for name, function, owner in _functions(ast.parse(source))
        if any(_names_namespace(parameter.annotation) for parameter in function.args.args)
        and not _allowed("x.py", name, function, owner)
    ]
    assert found == ["helper", "serve", "StageConfig.from_args", "Servicer.from_options"]


def test_no_namespace_parameter_below_main() -> None:
    assert list(_product_modules()), f"no product modules found under {ROOT}"
    found = namespace_parameters()
    assert not found, (
        "functions below a service's main take the parsed options; build the service's config in main "
        "(its from_options) and pass the parts instead:\n" + "\n".join(found)
    )
