"""docs/features.md is the registry's table, and every supported cell has a test that exists."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from families.base import FEATURES, LORA_WITH
from families.registry import FAMILIES, render_markdown

REPO = Path(__file__).resolve().parent.parent


def test_committed_table_matches_the_registry() -> None:
    committed = (REPO / "docs" / "features.md").read_text()
    assert committed == render_markdown(), "docs/features.md is stale: `python -m families.registry > docs/features.md`"


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_supported_cell_names_existing_tests(family: str) -> None:
    for feature in FEATURES:
        support = FAMILIES[family].support(feature)
        if not support.supported:
            assert support.reason, f"{family} / {feature}: an unsupported cell must say why"
            continue
        for reference in support.tests:
            path, name = reference.split("::")
            assert (REPO / path).is_file(), f"{family} / {feature}: {path} does not exist"
            assert name in _test_names(REPO / path), f"{family} / {feature}: no test {name} in {path}"


def test_every_lora_combination_names_existing_tests() -> None:
    """The "LoRA adapters with other options" table: each supported cell names its tests, each refused one says
    why and names the tests of its refusal."""
    for feature, support in LORA_WITH.items():
        assert feature in FEATURES
        tests = support.tests if support.supported else support.refusal_tests
        assert tests and (support.supported or support.reason), feature
        for reference in tests:
            path, name = reference.split("::")
            assert name in _test_names(REPO / path), f"LoRA / {feature}: no test {name} in {path}"
