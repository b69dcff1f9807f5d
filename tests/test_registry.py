"""The model registry (families/registry.py): how checkpoints find their family, and that every family's
declarations point at stages, proto services and compute that exist.

The registry is the only place that lists families: a stage or the orchestrator asks a checkpoint's family
what it runs, and never compares a family's name itself.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from families import registry
from families.base import Family
from families.registry import FAMILIES, FAMILY_NAMES, REGISTRY, family_for_index, family_named
from services.stage_table import STAGES
from stagediff.v1 import stages_pb2

REPO = Path(__file__).resolve().parent.parent
# The packages that must not know families by name: the stage runtimes, what every server shares, the client.
PRODUCT_PACKAGES = ("services", "dit_svc", "vae_svc", "text_encoder_svc", "interp_svc", "stagediff")
COMPUTE_PARTS = ("checkpoint_reader", "text_encoder", "denoiser", "decoder", "writer")

WAN_INDEX = {
    "_class_name": "WanPipeline",
    "_diffusers_version": "0.35.0",
    "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "WanTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLWan"],
}
A14B_INDEX = {**WAN_INDEX, "transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875}
QWEN_INDEX = {
    "_class_name": "QwenImagePipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}


def _without(index: dict, key: str) -> dict:
    return {name: value for name, value in index.items() if name != key}


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        (WAN_INDEX, "wan-t2v"),
        (A14B_INDEX, "wan2.2-a14b"),
        # Both the second expert and the boundary make an A14B; either alone is a plain Wan checkpoint.
        (_without(A14B_INDEX, "boundary_ratio"), "wan-t2v"),
        (_without(A14B_INDEX, "transformer_2"), "wan-t2v"),
        # diffusers writes a component it left out as [null, null].
        ({**A14B_INDEX, "transformer_2": [None, None]}, "wan-t2v"),
        ({**A14B_INDEX, "boundary_ratio": None}, "wan-t2v"),
        (QWEN_INDEX, "qwen-image"),
    ],
    ids=["wan", "a14b", "a14b-without-boundary", "a14b-without-expert", "expert-left-out", "boundary-null", "qwen"],
)
def test_family_for_index(index: dict, expected: str) -> None:
    family = family_for_index(index)
    assert family is not None and family.name == expected, family
    assert family is family_named(expected) is FAMILIES[expected]


@pytest.mark.parametrize(
    "index",
    [{"_class_name": "FluxPipeline"}, {"_class_name": ""}, {}, {**WAN_INDEX, "_class_name": "wanpipeline"}],
    ids=["another-pipeline", "empty-class-name", "no-class-name", "case-differs"],
)
def test_an_unknown_pipeline_has_no_family(index: dict) -> None:
    assert family_for_index(index) is None


def test_an_unknown_family_name_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError) as raised:
        family_named("hunyuan-video")
    message = str(raised.value)
    assert "'hunyuan-video' is not known" in message and all(name in message for name in FAMILY_NAMES), message


def test_the_registry_lists_each_family_under_its_class_name() -> None:
    assert tuple(FAMILIES) == FAMILY_NAMES
    # Two declarations under one name would leave one of them out of FAMILIES without a word.
    declared = [family for module in registry._FAMILY_MODULES for family in importlib.import_module(module).FAMILIES]
    assert sorted(family.name for family in declared) == sorted(FAMILY_NAMES)
    listed = [family for families in REGISTRY.values() for family in families]
    assert sorted(family.name for family in listed) == sorted(FAMILY_NAMES)
    for class_name, families in REGISTRY.items():
        assert all(family.class_name == class_name for family in families), class_name
        # The most specific family is tried first: otherwise an A14B index would match plain wan-t2v.
        requires = [len(family.requires) for family in families]
        assert requires == sorted(requires, reverse=True), class_name


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILY_NAMES)
def test_each_chain_runs_known_stages(family: Family) -> None:
    assert family.chain, family.name
    unknown = [stage for stage in family.chain if stage not in STAGES]
    assert unknown == [], f"{family.name}: stages {unknown} are not stage kinds ({', '.join(STAGES)})"
    assert len(set(family.chain)) == len(family.chain), f"{family.name}: {family.chain} repeats a stage"
    stray = [stage for stage in family.optional_stages if stage not in family.chain]
    assert stray == [], f"{family.name}: optional stages {stray} are not in its chain {family.chain}"
    assert family.required_stages(), f"{family.name}: every stage of its chain is optional"


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILY_NAMES)
def test_each_conditioning_mask_belongs_to_embeddings_of_its_family(family: Family) -> None:
    slots = {slot.name: slot for slot in family.conditioning}
    assert len(slots) == len(family.conditioning), f"{family.name}: a conditioning slot is declared twice"
    assert any(slot.kind == "embeds" and slot.needed == "always" for slot in slots.values()), family.name
    for slot in slots.values():
        if slot.kind == "mask":
            assert slot.of in slots and slots[slot.of].kind == "embeds", f"{family.name}: {slot}"
        else:
            assert slot.of is None, f"{family.name}: {slot}"


@pytest.mark.parametrize("part", COMPUTE_PARTS)
@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILY_NAMES)
def test_each_compute_import_path_resolves(family: Family, part: str) -> None:
    compute = family.load(part)
    assert callable(compute), f"{family.name} {part}: {getattr(family, part)} is not callable"


@pytest.mark.parametrize("stage", STAGES.values(), ids=list(STAGES))
def test_each_stage_kind_has_its_proto_service_and_a_main(stage) -> None:
    services = {service.full_name for service in stages_pb2.DESCRIPTOR.services_by_name.values()}
    assert stage.service in services, f"{stage.name}: {stage.service} is not one of {sorted(services)}"
    module = importlib.import_module(stage.module)
    assert callable(getattr(module, "main", None)), f"{stage.name}: {stage.module} has no main(argv)"


def _family_name_literals(paths: list[Path]) -> dict[str, str]:
    """Every string constant equal to a family's name in these files: {'path:line': name}."""
    found = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in FAMILY_NAMES:
                found[f"{path.relative_to(REPO)}:{node.lineno}"] = node.value
    return found


def test_no_product_module_outside_families_names_a_family() -> None:
    """A stage asks the checkpoint's Family for its chain, conditioning and features instead of comparing names."""
    paths = [path for package in PRODUCT_PACKAGES for path in sorted((REPO / package).rglob("*.py"))]
    assert len(paths) > 50, f"only {len(paths)} product modules found under {PRODUCT_PACKAGES}"
    # The search finds the names where they belong: each family's declaration.
    declared = _family_name_literals(sorted((REPO / "families").rglob("family.py")))
    assert set(declared.values()) == set(FAMILY_NAMES), declared
    found = _family_name_literals(paths)
    assert found == {}, "family names outside families/:\n" + "\n".join(f"{at}: {name!r}" for at, name in found.items())
