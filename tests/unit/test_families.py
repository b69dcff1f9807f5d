"""Model families beyond Wan2.1: Wan2.2-T2V-A14B (two experts) and Qwen-Image (text-to-image, true CFG).

Their random-weight checkpoints load unchanged in the diffusers pipelines; detection, presets, embeddings and
the registry's refusals are checked in process (the cluster runs are tests/e2e/test_families_cluster.py).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from families.base import FEATURES
from families.qwen_image.family import QWEN_IMAGE
from families.qwen_image.init_model import DEFAULT_REQUESTS as QWEN_DEFAULT_REQUESTS
from families.qwen_image.init_model import PROMPT_DROP_TOKENS as QWEN_PROMPT_DROP_TOKENS
from families.qwen_image.init_model import PROMPT_TEMPLATE_PREFIX as QWEN_PROMPT_TEMPLATE_PREFIX
from families.qwen_image.init_model import SCHEDULER_CONFIG as QWEN_SCHEDULER_CONFIG
from families.qwen_image.init_model import TEXT_ENCODER_CONFIGS as QWEN_TEXT_ENCODER_CONFIGS
from families.qwen_image.init_model import TRANSFORMER_CONFIGS as QWEN_TRANSFORMER_CONFIGS
from families.qwen_image.init_model import VAE_CONFIGS as QWEN_VAE_CONFIGS
from families.registry import FAMILIES
from families.wan.presets import A14B_BOUNDARY_RATIO
from services.checkpoint import read_checkpoint
from tests.helpers.feature_mixins import FEATURE_MIXINS, TESTER_CONFIGS
from tests.helpers.node_ids import class_bases, feature_class, node_exists
from tests.helpers.qwen_references import qwen_reference


def test_every_refusal_in_the_registry_names_existing_tests() -> None:
    """A flag refused at startup is unsupported, and the tests of its refusal exist."""
    for family in FAMILIES.values():
        for feature in FEATURES:
            support = family.support(feature)
            if not support.refusal_tests:
                continue
            assert not support.supported and support.reason, f"{family.name} / {feature}"
            assert support.cell().endswith("; refused at startup"), support.cell()
            for reference in support.refusal_tests:
                assert node_exists(reference), f"{family.name} / {feature}: no test {reference}"


FEATURE_TESTS = "tests/integration/test_family_features.py"


def test_feature_cells_name_the_classes_of_their_family_and_feature_mixin() -> None:
    """A test class a `Support` entry names combines that family's tester config with mixins, and a cell of a
    feature that has a mixin names a class with that mixin; a family with a tester config names one in every
    supported cell of such a feature."""
    for family in FAMILIES.values():
        for feature in FEATURES:
            support = family.support(feature)
            classes = [found for found in map(feature_class, (*support.tests, *support.refusal_tests)) if found]
            for config, _ in classes:
                assert config.family == family.name, f"{family.name} / {feature}: names {config.__name__}'s tests"
            mixin = FEATURE_MIXINS.get(feature)
            if mixin is None:
                continue
            for config, bases in classes:
                assert any(issubclass(base, mixin) for base in bases), (
                    f"{family.name} / {feature}: a class of {config.__name__} without {mixin.__name__}"
                )
            has_config = any(config.family == family.name for config in TESTER_CONFIGS)
            if support.supported and has_config:
                assert classes, f"{family.name} / {feature}: name the test class that mixes in {mixin.__name__}"


def test_every_tester_config_is_a_family_and_every_feature_class_combines_one() -> None:
    """Adding a family means writing its tester config (a registered family) and its test classes, each of
    one tester config and at least one feature mixin (or a mixin's subclass with more checks for the configs that
    have more to check, as the step-scheduling mixin's for further schedulers and for two experts)."""
    mixins = set(FEATURE_MIXINS.values())
    assert {config.family for config in TESTER_CONFIGS} <= set(FAMILIES)
    tree = ast.parse((Path(__file__).resolve().parents[2] / FEATURE_TESTS).read_text())
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    combined: dict[type, set[type]] = {config: set() for config in TESTER_CONFIGS}
    for name in classes:
        bases = class_bases(FEATURE_TESTS, name)
        assert bases is not None, f"{name}: bases must come from tests/helpers/feature_mixins/"
        configs = [base for base in bases if base in TESTER_CONFIGS]
        features = {mixin for base in set(bases) - set(configs) for mixin in mixins if issubclass(base, mixin)}
        assert len(configs) == 1 and len(features) == len(bases) - 1 and len(bases) > 1, name
        combined[configs[0]] |= features
    for config, used in combined.items():
        family = FAMILIES[config.family]
        needed = {mixin for feature, mixin in FEATURE_MIXINS.items() if family.support(feature).supported}
        assert needed <= used, f"{config.__name__}: no test class with {sorted(m.__name__ for m in needed - used)}"


def test_qwen_refusals_in_the_registry() -> None:
    """qwen-image runs every DiT parallel method and refuses only VAE tiling at startup; wan-t2v supports every
    feature, A14B all but regional compilation, MagCache (its ratios index one schedule) and LoRA adapters (one
    expert or both is not settled against its pipeline yet)."""
    from stagekit.parallel.mesh import METHOD_FLAGS

    assert FAMILIES["qwen-image"] is QWEN_IMAGE
    assert all(QWEN_IMAGE.support(feature).supported for feature in METHOD_FLAGS)
    refused = {feature for feature in FEATURES if QWEN_IMAGE.support(feature).refused_at_startup}
    assert refused == {"vae_tiling"}
    for name, expected in (("wan-t2v", []), ("wan2.2-a14b", ["compile", "mag_cache", "lora", "lora_fused"])):
        unsupported = [feature for feature in FEATURES if not FAMILIES[name].support(feature).supported]
        assert unsupported == expected, f"{name}: {unsupported}"


def test_family_detection(qwen_model: Path, a14b_model: Path, tmp_path: Path) -> None:
    assert read_checkpoint(qwen_model).family == "qwen-image"
    assert read_checkpoint(a14b_model).family == "wan2.2-a14b"
    # A WanPipeline index without a second expert stays wan-t2v, even with a stray boundary_ratio.
    index = json.loads((a14b_model / "model_index.json").read_text())
    for drop in ("transformer_2", "boundary_ratio"):
        copy = tmp_path / drop
        copy.mkdir()
        for name in ("vae", "transformer", "scheduler"):
            (copy / name).symlink_to(a14b_model / name)
        (copy / "model_index.json").write_text(json.dumps({k: v for k, v in index.items() if k != drop}))
        assert read_checkpoint(copy).family == "wan-t2v"

    spec = read_checkpoint(qwen_model)
    assert (spec.height_multiple, spec.width_multiple) == (16, 16)
    assert spec.max_frames == 1 and spec.latent_channels == 16
    assert spec.defaults.num_frames == 1
    assert spec.defaults.guidance_scale == QWEN_DEFAULT_REQUESTS["tiny"]["guidance_scale"]


def test_a14b_checkpoint_loads_in_wan_pipeline(a14b_pipeline) -> None:
    from diffusers import WanTransformer3DModel

    assert isinstance(a14b_pipeline.transformer, WanTransformer3DModel)
    assert isinstance(a14b_pipeline.transformer_2, WanTransformer3DModel)
    assert a14b_pipeline.config.boundary_ratio == A14B_BOUNDARY_RATIO
    first = dict(a14b_pipeline.transformer.named_parameters())
    second = dict(a14b_pipeline.transformer_2.named_parameters())
    assert first.keys() == second.keys()
    assert not torch.equal(first["blocks.0.attn1.to_q.weight"], second["blocks.0.attn1.to_q.weight"])
    # Two UniPC steps cross the boundary: 999 on the high-noise expert, 750 on the low-noise one.
    a14b_pipeline.scheduler.set_timesteps(2)
    boundary = A14B_BOUNDARY_RATIO * a14b_pipeline.scheduler.config.num_train_timesteps
    timesteps = a14b_pipeline.scheduler.timesteps.tolist()
    assert timesteps[0] >= boundary > timesteps[-1]


def test_qwen_checkpoint_loads_and_runs_in_qwen_image_pipeline(qwen_model: Path, qwen_pipeline) -> None:
    from transformers import Qwen2Tokenizer

    index = json.loads((qwen_model / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert type(getattr(qwen_pipeline, name)).__name__ == index[name][1]
    assert isinstance(qwen_pipeline.tokenizer, Qwen2Tokenizer)
    scheduler = qwen_pipeline.scheduler.config
    for key, value in QWEN_SCHEDULER_CONFIG.items():
        assert scheduler[key] == value, key
    # The pipeline drops the template's first 34 tokens: with this tokenizer they are exactly the template.
    tokenizer = qwen_pipeline.tokenizer
    assert qwen_pipeline.prompt_template_encode_start_idx == QWEN_PROMPT_DROP_TOKENS
    assert len(tokenizer(QWEN_PROMPT_TEMPLATE_PREFIX).input_ids) == QWEN_PROMPT_DROP_TOKENS
    assert qwen_pipeline.prompt_template_encode.startswith(QWEN_PROMPT_TEMPLATE_PREFIX)
    for token in ("<|im_start|>", "<|im_end|>"):
        assert tokenizer.tokenize(token) == [token]

    images = qwen_reference(
        qwen_pipeline, prompt="a red fox", negative_prompt="blurry", height=64, width=64, steps=2, guidance=4.0, seed=0
    )
    assert images.shape == (1, 64, 64, 3) and images.std() > 1.0


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_qwen_preset_configs_fit_together(preset: str) -> None:
    transformer, vae = QWEN_TRANSFORMER_CONFIGS[preset], QWEN_VAE_CONFIGS[preset]
    text = QWEN_TEXT_ENCODER_CONFIGS[preset]["text"]
    assert transformer["in_channels"] == 4 * vae["z_dim"] and transformer["out_channels"] == vae["z_dim"]
    assert transformer["joint_attention_dim"] == text["hidden_size"]
    assert sum(transformer["axes_dims_rope"]) == transformer["attention_head_dim"]
    assert all(dim % 2 == 0 for dim in transformer["axes_dims_rope"])
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert 2 * sum(text["mrope_section"]) == head_dim
    request = QWEN_DEFAULT_REQUESTS[preset]
    assert request["height"] % 16 == 0 and request["width"] % 16 == 0 and request["num_frames"] == 1


def test_qwen_embeddings_drop_padding_like_the_pipeline() -> None:
    from families.qwen_image.denoise import QwenTextEmbeds

    embeds = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    short = QwenTextEmbeds.from_wire(embeds[0:1], mask[0:1])
    assert torch.equal(short.embeds, embeds[0:1, :3]) and short.mask is None
    full = QwenTextEmbeds.from_wire(embeds[1:2], mask[1:2])
    assert torch.equal(full.embeds, embeds[1:2]) and full.mask is None
    holes = QwenTextEmbeds.from_wire(embeds[0:1], torch.tensor([[1, 0, 1, 0, 0]]))
    assert holes.embeds.shape[1] == 3 and holes.mask.tolist() == [[1, 0, 1]]
    # As the DiT stage hands them over: each text's embeddings by name, its mask under "<name>_mask" when sent.
    conditioning = {
        "prompt_embeds": embeds[1:2],
        "negative_prompt_embeds": embeds[0:1],
        "negative_prompt_embeds_mask": torch.tensor([[1, 0, 1, 0, 0]]),
    }
    prompt = QwenTextEmbeds.from_conditioning(conditioning, "prompt_embeds")
    assert torch.equal(prompt.embeds, embeds[1:2]) and prompt.mask is None
    negative = QwenTextEmbeds.from_conditioning(conditioning, "negative_prompt_embeds")
    assert torch.equal(negative.embeds, embeds[0:1, :3]) and negative.mask.tolist() == [[1, 0, 1]]


@pytest.mark.parametrize(
    "flags",
    [
        ["--ring-degree", "2", "--ulysses-degree", "2"],
        ["--ring-degree", "2", "--cfg-parallel-size", "2"],
        ["--tensor-parallel-size", "2"],
        ["--tensor-parallel-size", "2", "--ring-degree", "2"],
        ["--use-hsdp", "--hsdp-shard-size", "2"],
        ["--use-hsdp", "--hsdp-shard-size", "2", "--ulysses-degree", "2"],
    ],
)
def test_qwen_dit_layout_check_accepts_ring_tensor_and_hsdp(qwen_model, flags) -> None:
    from dit_svc.config import DitConfig
    from tests.helpers.serving import parse_serve

    DitConfig.from_args(parse_serve(["dit", "--model", str(qwen_model), "--device", "cpu", *flags]))
    # What the model cannot split is still refused, naming what would: the tiny transformer has 4 heads.
    with pytest.raises(SystemExit) as raised:
        DitConfig.from_args(
            parse_serve(["dit", "--model", str(qwen_model), "--device", "cpu", *flags, "--ulysses-degree", "8"])
        )
    assert "4 attention heads" in str(raised.value) and "[1, 2, 4]" in str(raised.value), raised.value


def test_qwen_dit_layout_check_accepts_ulysses(qwen_model) -> None:
    from dit_svc.config import DitConfig
    from tests.helpers.serving import parse_serve

    for flags in (["--ulysses-degree", "2"], ["--ulysses-degree", "2", "--cfg-parallel-size", "2"]):
        DitConfig.from_args(parse_serve(["dit", "--model", str(qwen_model), "--device", "cpu", *flags]))
