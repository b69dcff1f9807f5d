"""The model registry: every family this build serves, keyed by the checkpoint's diffusers `_class_name`.

This is the one place that lists families. Adding a family is its folder under families/ (declarations in
`family.py`, compute beside them) and one line in `_FAMILY_MODULES` below.

`docs/features.md` is generated from the registry (`python -m families.registry > docs/features.md`); tests
check that the committed page matches, that every supported cell names a test that exists, and that every
flag refused at startup names the tests of its refusal.
"""

from __future__ import annotations

import importlib
import sys

from families.base import FEATURES, LORA_WITH, Family

# Each module declares FAMILIES, a tuple of Family.
_FAMILY_MODULES = (
    "families.wan.family",
    "families.qwen_image.family",
    "families.wan_i2v.family",
    "families.qwen_image_edit.family",
    "families.flux.family",
    "families.z_image.family",
    "families.flux2_klein.family",
    "families.flux_kontext.family",
    "families.qwen_image_21.family",
    "families.hunyuanvideo_15.family",
    "families.ltx2.family",
)

FAMILIES: dict[str, Family] = {
    family.name: family for module in _FAMILY_MODULES for family in importlib.import_module(module).FAMILIES
}
# model_index.json `_class_name` -> its families, most specific (most `requires`) first.
REGISTRY: dict[str, tuple[Family, ...]] = {}
for _family in sorted(FAMILIES.values(), key=lambda family: -len(family.requires)):
    REGISTRY[_family.class_name] = (*REGISTRY.get(_family.class_name, ()), _family)
FAMILY_NAMES = tuple(FAMILIES)


def family_for_index(index: dict) -> Family | None:
    """The family of a model_index.json, or None when this build cannot serve it.

    A family matches when the index names every component and config entry in its `requires` (Wan2.2-A14B
    is a WanPipeline that names `transformer_2` and sets `boundary_ratio`).
    """
    for family in REGISTRY.get(index.get("_class_name", ""), ()):
        if all(_names(index, key) for key in family.requires):
            return family
    return None


def family_named(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"family '{name}' is not known; known: {', '.join(FAMILIES)}") from None


def _names(index: dict, key: str) -> bool:
    entry = index.get(key)
    if isinstance(entry, list):  # a component: [library, class], class None when left out
        return len(entry) == 2 and entry[1] is not None
    if isinstance(entry, bool):  # a switch (expand_timesteps) names the family only when on
        return entry
    return entry is not None


def render_markdown() -> str:
    """The feature compatibility table as docs/features.md shows it."""
    lines = [
        "# Feature compatibility",
        "",
        "Generated from the model registry (`families/registry.py`, each family's `family.py`) by",
        "`python -m families.registry`; a test fails when this page and the registry disagree, and when a",
        "supported cell or a refusal has no test behind it.",
        "",
        "| feature | " + " | ".join(FAMILIES) + " |",
        "| --- | " + " | ".join("---" for _ in FAMILIES) + " |",
    ]
    for key, title in FEATURES.items():
        cells = [family.support(key).cell() for family in FAMILIES.values()]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## LoRA adapters with other options",
        "",
        "Adapters applied per request (`--lora-dir`), in every family that serves them. Adapters fused at startup",
        "(`--lora`) change the base weights before quantization, offload, the parallel plan and compilation, so",
        "they combine with all of those but tensor parallelism and HSDP (refused at startup: those load each",
        "rank's shards of the weights).",
        "",
        "| option | with adapters per request |",
        "| --- | --- |",
    ]
    for key, support in LORA_WITH.items():
        lines.append(f"| {FEATURES[key]} | {support.cell()} |")
    lines += [
        "",
        "## Chains of stages",
        "",
        "| family | output | stages (optional in brackets) |",
        "| --- | --- | --- |",
    ]
    for family in FAMILIES.values():
        stages = " -> ".join(f"[{s}]" if s in family.optional_stages else s for s in family.chain)
        lines.append(f"| {family.name} | {family.output} | {stages} |")
    lines += ["", "## Tests behind each supported cell and each refusal", ""]
    lines.append("### LoRA adapters per request with other options")
    lines.append("")
    for key, support in LORA_WITH.items():
        tests = support.tests or support.refusal_tests
        lines.append(f"- {FEATURES[key]}: " + ", ".join(f"`{test}`" for test in tests))
    lines.append("")
    for family in FAMILIES.values():
        lines.append(f"### {family.name} ({family.pipeline})")
        lines.append("")
        lines.append(family.description)
        lines.append("")
        for key in FEATURES:
            support = family.support(key)
            if support.supported:
                lines.append(f"- {FEATURES[key]}: " + ", ".join(f"`{test}`" for test in support.tests))
        refused = [key for key in FEATURES if family.support(key).refused_at_startup]
        if refused:
            lines += ["", "Refused at startup, and the tests of each refusal:", ""]
            for key in refused:
                tests = family.support(key).refusal_tests
                lines.append(f"- {FEATURES[key]}: " + ", ".join(f"`{test}`" for test in tests))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
