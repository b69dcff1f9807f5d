"""The model registry (families/registry.py): how checkpoints find their family, and that every family's
declarations point at stages, proto services and compute that exist, each part of its compute following its
protocol (stagekit/family_parts.py).

The registry is the only place that lists families: a stage or the orchestrator asks a checkpoint's family
what it runs, and never compares a family's name itself.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
import types
from pathlib import Path
from typing import Protocol, get_args

import pytest

from families import registry
from families.base import Family, FamilyPart
from families.registry import FAMILIES, FAMILY_NAMES, REGISTRY, family_for_index, family_named
from services.stage_table import STAGES
from stagediff.v1 import stages_pb2
from stagekit.decode import LatentDecoder
from stagekit.denoise import BatchDenoiser, Denoiser, ImageDenoiser
from stagekit.encoder import PromptEncoder
from stagekit.family_parts import PART_PROTOCOLS

REPO = Path(__file__).resolve().parents[2]
# The packages that must not know families by name: the stage runtimes, what every server shares, the client.
PRODUCT_PACKAGES = ("services", "dit_svc", "vae_svc", "text_encoder_svc", "interp_svc", "stagediff")
# The parts every family names; the others ("" where a family has none) only some.
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
    [
        {"_class_name": "StableDiffusionXLPipeline"},
        {"_class_name": ""},
        {},
        {**WAN_INDEX, "_class_name": "wanpipeline"},
    ],
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


def test_every_part_load_takes_has_a_protocol() -> None:
    assert set(get_args(FamilyPart)) == set(PART_PROTOCOLS), "families.base.FamilyPart and PART_PROTOCOLS differ"
    assert set(COMPUTE_PARTS) < set(PART_PROTOCOLS)


def _signature_problems(expected: inspect.Signature, actual: inspect.Signature) -> list[str]:
    """Why a callable of signature `actual` cannot be called as `expected` allows (both without `self`): each
    positional parameter at its place and with its name, each keyword parameter by name, a default wherever
    `expected` has one, and no other required parameter."""
    problems = []
    params = list(actual.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_positional = any(p.kind == p.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind == p.VAR_KEYWORD for p in params)
    by_name = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    matched: set[str] = set()
    index = 0
    for want in expected.parameters.values():
        if want.kind in (want.VAR_POSITIONAL, want.VAR_KEYWORD):
            continue
        if want.kind in (want.POSITIONAL_ONLY, want.POSITIONAL_OR_KEYWORD):
            if index < len(positional):
                have = positional[index]
                if want.kind == want.POSITIONAL_OR_KEYWORD and have.name != want.name:
                    problems.append(f"positional parameter {index} is '{have.name}', expected '{want.name}'")
            elif not var_positional:
                problems.append(f"takes no positional parameter {index} ('{want.name}')")
                index += 1
                continue
            else:
                have = None
            index += 1
        else:
            have = by_name.get(want.name)
            if have is None and not var_keyword:
                problems.append(f"takes no keyword parameter '{want.name}'")
                continue
        if have is not None:
            matched.add(have.name)
            if want.default is not want.empty and have.default is have.empty:
                problems.append(f"parameter '{have.name}' has no default, but callers may leave it out")
    for have in params:
        unmatched = have.name not in matched and have.kind not in (have.VAR_POSITIONAL, have.VAR_KEYWORD)
        if unmatched and have.default is have.empty:
            problems.append(f"requires parameter '{have.name}', which callers do not pass")
    return problems


def _without_self(signature: inspect.Signature) -> inspect.Signature:
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def part_problems(family: Family, part: str) -> list[str]:
    """What is wrong with a family's part against its protocol (stagekit/family_parts.py), [] when nothing."""
    path = getattr(family, part)
    try:
        compute = family.load(part)
    except (ImportError, AttributeError, ValueError) as error:
        return [f"{path} does not import: {error!r}"]
    if not callable(compute):
        return [f"{path} is not callable"]
    protocol = PART_PROTOCOLS[part]
    expected = _without_self(inspect.signature(protocol.__call__))
    problems = [
        f"{path}{inspect.signature(compute)}: {why}"
        for why in _signature_problems(expected, inspect.signature(compute))
    ]
    # A class part's instances follow the stage's protocol (stagekit/encoder.py, denoise.py, decode.py).
    instance_protocols = {"text_encoder": (PromptEncoder,), "decoder": (LatentDecoder,), "denoiser": (Denoiser,)}
    if part == "denoiser" and family.support("batching").supported:
        instance_protocols["denoiser"] = (BatchDenoiser,)
    if part == "denoiser" and family.images.roles:
        instance_protocols["denoiser"] += (ImageDenoiser,)
    for instance_protocol in instance_protocols.get(part, ()):
        if not isinstance(compute, type):
            problems.append(f"{path} is not a class of {instance_protocol.__name__}")
        elif not getattr(instance_protocol, "_is_protocol", False):
            if not issubclass(compute, instance_protocol):
                problems.append(f"{path} is not a subclass of {instance_protocol.__name__}")
        else:
            problems += [f"{path}: {why}" for why in _class_problems(compute, instance_protocol)]
    return problems


def _protocol_members(protocol: type) -> set[str]:
    """The names a Protocol declares, its bases' included (typing.get_protocol_members from Python 3.13)."""
    return {
        name
        for base in protocol.__mro__
        if getattr(base, "_is_protocol", False) and base is not Protocol
        for name in (*vars(base), *vars(base).get("__annotations__", {}))
        if not name.startswith("_")
    }


def _class_problems(cls: type, protocol: type) -> list[str]:
    """The methods and properties of a Protocol that a class lacks or whose signature differs (its data members
    are set by the constructor, which only an instance shows)."""
    problems = []
    for name in sorted(_protocol_members(protocol)):
        declared = inspect.getattr_static(protocol, name, None)
        if declared is None:  # a data member
            continue
        have = inspect.getattr_static(cls, name, None)
        if have is None:
            problems.append(f"has no '{name}' ({protocol.__name__})")
        elif isinstance(declared, property):
            if not isinstance(have, property) and callable(have):
                problems.append(f"'{name}' is a method, {protocol.__name__} has a property")
        elif callable(declared):
            if not callable(have) or isinstance(have, property):
                problems.append(f"'{name}' is not a method ({protocol.__name__})")
                continue
            for why in _signature_problems(
                _without_self(inspect.signature(declared)), _without_self(inspect.signature(getattr(cls, name)))
            ):
                problems.append(f"{name}: {why} ({protocol.__name__})")
    return problems


_REGISTERED_PARTS = [
    pytest.param(family, part, id=f"{family.name}-{part}")
    for family in FAMILIES.values()
    for part in PART_PROTOCOLS
    if getattr(family, part) or part in COMPUTE_PARTS
]


@pytest.mark.parametrize(("family", "part"), _REGISTERED_PARTS)
def test_each_registered_part_follows_its_protocol(family: Family, part: str) -> None:
    """Imports the part and checks its signature (and a class part's methods) against its protocol."""
    problems = part_problems(family, part)
    assert problems == [], f"{family.name} {part} ({PART_PROTOCOLS[part].__name__}):\n" + "\n".join(problems)


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))
def test_a_denoiser_runs_steps_exactly_where_its_family_declares_step_scheduling(family: Family) -> None:
    """A denoiser class that says its loop is written as steps (`runs_steps = True`, stagekit/denoise_steps.py)
    has `begin` and `step`, and its family's step_scheduling cell is supported; a family that declares the
    feature has such a denoiser."""
    denoiser = family.load("denoiser")
    steps = getattr(denoiser, "runs_steps", False) is True
    if steps:
        assert callable(getattr(denoiser, "begin", None)) and callable(getattr(denoiser, "step", None)), family.name
    supported = family.support("step_scheduling").supported
    assert steps == supported, f"{family.name}: runs_steps {steps}, step_scheduling supported {supported}"


def test_every_family_taking_images_on_the_vae_names_its_image_encoder() -> None:
    missing = [
        family.name for family in FAMILIES.values() if "vae" in family.images.encoded_by and not family.image_encoder
    ]
    assert missing == [], f"families whose VAE stage encodes input images without an image_encoder: {missing}"


class _WrongDenoiser:
    """A denoiser whose constructor and `denoise` take other arguments than the stage passes."""

    transformer = None
    parallel = None
    cfg_group = None

    def __init__(self, model_dir: str, device: object) -> None: ...

    @property
    def experts(self) -> list:
        return []

    @property
    def text_dim(self) -> int:
        return 0

    def image_tensor_shape(self, name: str, spec: object) -> None: ...

    def denoise(self, spec: object, conditioning: dict) -> None: ...


def broken_reader(root: str, configs: dict) -> dict:
    """Takes the checkpoint's root before its configs, unlike GeometryReader."""
    return {}


def test_a_part_with_the_wrong_signature_is_named_with_its_family_and_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails when a part's signature is wrong: parts registered in a copy of a family here."""
    module = types.ModuleType("broken_family_parts")
    module.reader = lambda root, model_index, configs: {}  # takes the root and the index too
    module.writer = lambda family, out: None
    module.names = lambda: ""
    module.denoiser = _WrongDenoiser
    module.reader_two = broken_reader
    module.good_reader = lambda configs: {}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    family = dataclasses.replace(
        FAMILIES["wan-t2v"],
        checkpoint_reader="broken_family_parts:reader",
        writer="broken_family_parts:writer",
        gguf_names="broken_family_parts:names",
        denoiser="broken_family_parts:denoiser",
        text_encoder="broken_family_parts:missing",
    )
    reader = part_problems(family, "checkpoint_reader")
    assert any("positional parameter 0 is 'root', expected 'configs'" in why for why in reader), reader
    assert any("requires parameter 'configs'" in why for why in reader), reader
    writer = part_problems(family, "writer")
    assert any("takes no positional parameter 2 ('preset')" in why for why in writer), writer
    assert part_problems(family, "gguf_names") == [
        "broken_family_parts:names(): takes no positional parameter 0 ('name')"
    ]
    denoiser = "\n".join(part_problems(family, "denoiser"))
    assert "requires parameter 'device'" not in denoiser  # it takes it, where the stage passes it
    assert "positional parameter 2" in denoiser and "takes no keyword parameter 'parallel'" in denoiser, denoiser
    assert "denoise: takes no positional parameter 2 ('on_step') (BatchDenoiser)" in denoiser, denoiser
    assert "has no 'denoise_batch' (BatchDenoiser)" in denoiser, denoiser  # wan-t2v declares batching
    assert "does not import" in part_problems(family, "text_encoder")[0]
    assert part_problems(
        dataclasses.replace(family, checkpoint_reader="broken_family_parts:reader_two"), "checkpoint_reader"
    )
    assert (
        part_problems(
            dataclasses.replace(family, checkpoint_reader="broken_family_parts:good_reader"), "checkpoint_reader"
        )
        == []
    )
    # The test above reports it with the family and the part.
    with pytest.raises(AssertionError, match=r"wan-t2v checkpoint_reader \(GeometryReader\)"):
        test_each_registered_part_follows_its_protocol(family, "checkpoint_reader")


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
