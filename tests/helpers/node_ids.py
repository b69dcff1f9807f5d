"""Test node ids as the families' `Support` entries name them, checked without running the tests.

A node id is `path::test_name`, `path::TestClass` or `path::TestClass::test_name`. A test class may take its
tests from the mixins of tests/helpers/feature_mixins/: its bases are resolved in that package, so that a class
that combines a tester config with a feature mixin names the mixin's tests too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import feature_mixins

REPO = Path(__file__).resolve().parents[2]


def _tree(path: str) -> ast.Module:
    return ast.parse((REPO / path).read_text())


def defined_tests(path: str) -> set[str]:
    """Every test function and method defined in the file."""
    return {
        node.name
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
    }


def class_bases(path: str, name: str) -> tuple[type, ...] | None:
    """The bases of test class `name` in `path`, resolved among feature_mixins' exports; None when the file has
    no such class or a base is not exported there."""
    for node in _tree(path).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            bases = [getattr(feature_mixins, base.id, None) for base in node.bases if isinstance(base, ast.Name)]
            if len(bases) != len(node.bases) or not all(isinstance(base, type) for base in bases):
                return None
            return tuple(bases)  # type: ignore[arg-type]
    return None


def node_exists(reference: str) -> bool:
    """Whether the node id names a file that exists and a test, test class or test method in it."""
    path, *names = reference.split("::")
    if not (REPO / path).is_file() or len(names) not in (1, 2):
        return False
    if len(names) == 1 and names[0] in defined_tests(path):
        return True
    bases = class_bases(path, names[0])
    if bases is None or not names[0].startswith("Test"):
        return False
    return len(names) == 1 or any(callable(getattr(base, names[1], None)) for base in bases)


def feature_class(reference: str) -> tuple[type[feature_mixins.FamilyTesterConfig], tuple[type, ...]] | None:
    """The tester config and bases of the class a node id names, if it combines a tester config with mixins."""
    path, *names = reference.split("::")
    if not (REPO / path).is_file() or not names:
        return None
    bases = class_bases(path, names[0])
    configs = [base for base in bases or () if issubclass(base, feature_mixins.FamilyTesterConfig)]
    if bases is None or len(configs) != 1:
        return None
    return configs[0], bases
