"""docs/features.md is the registry's table, and every supported cell has a test that exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from families.base import FEATURES, LORA_WITH
from families.registry import FAMILIES, render_markdown
from tests.helpers.node_ids import node_exists

REPO = Path(__file__).resolve().parents[2]


def test_committed_table_matches_the_registry() -> None:
    committed = (REPO / "docs" / "features.md").read_text()
    assert committed == render_markdown(), "docs/features.md is stale: `python -m families.registry > docs/features.md`"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_supported_cell_names_existing_tests(family: str) -> None:
    for feature in FEATURES:
        support = FAMILIES[family].support(feature)
        if not support.supported:
            assert support.reason, f"{family} / {feature}: an unsupported cell must say why"
            continue
        for reference in support.tests:
            assert node_exists(reference), f"{family} / {feature}: no test {reference}"


def test_every_lora_combination_names_existing_tests() -> None:
    """The "LoRA adapters with other options" table: each supported cell names its tests, each refused one says
    why and names the tests of its refusal."""
    for feature, support in LORA_WITH.items():
        assert feature in FEATURES
        tests = support.tests if support.supported else support.refusal_tests
        assert tests and (support.supported or support.reason), feature
        for reference in tests:
            assert node_exists(reference), f"LoRA / {feature}: no test {reference}"
