"""Model families beyond Wan2.1: Wan2.2-T2V-A14B (two experts) and Qwen-Image (text-to-image, true CFG).

Their random-weight checkpoints load unchanged in the diffusers pipelines, and through the running
cluster (single DiT and parallel DiT layouts) the frames equal the in-process pipeline's within one level.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
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
from families.wan.init_model import A14B_BOUNDARY_RATIO
from services.checkpoint import read_checkpoint
from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.conftest import THREADS_PER_STAGE, reference_frames

# ------------------------------------------------------------------------------------------- fixtures


def _cluster(model: Path, log_dir: Path, dit_flags: list[str] | None = None) -> Iterator[LocalCluster]:
    local = LocalCluster(
        model, threads_per_stage=THREADS_PER_STAGE, log_dir=log_dir, extra_args={"dit": dit_flags or []}
    )
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def qwen_cluster(qwen_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from _cluster(qwen_model, tmp_path_factory.mktemp("qwen-cluster-logs"))


@pytest.fixture(scope="module")
def a14b_cluster(a14b_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from _cluster(a14b_model, tmp_path_factory.mktemp("a14b-cluster-logs"))


def qwen_reference(pipeline, *, prompt, negative_prompt, height, width, steps, guidance, seed) -> np.ndarray:
    """QwenImagePipeline's image for the arguments (guidance = true_cfg_scale) as uint8 [1, H, W, 3]."""
    images = pipeline(
        prompt,
        negative_prompt=negative_prompt,
        true_cfg_scale=guidance,
        height=height,
        width=width,
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    ).images
    return (np.clip(images, 0, 1) * 255).round().astype(np.uint8)


def _generate(endpoint: str, case: dict) -> np.ndarray:
    with Client(endpoint) as client:
        result = client.generate(
            case["prompt"],
            negative_prompt=case["negative_prompt"],
            height=case["height"],
            width=case["width"],
            num_frames=case.get("num_frames", 1),
            num_inference_steps=case["steps"],
            guidance_scale=case["guidance"],
            seed=case["seed"],
        )
    return result.frames


def _assert_close(frames: np.ndarray, expected: np.ndarray) -> None:
    assert frames.dtype == np.uint8 and frames.shape == expected.shape, (frames.shape, expected.shape)
    difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16))
    assert difference.max() <= 1, f"max difference {difference.max()} levels"
    assert expected.std() > 1.0, "the reference is flat: the comparison would prove little"


# ------------------------------------------------------------------------------------------- registry


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


def test_every_refusal_in_the_registry_names_existing_tests() -> None:
    """A flag refused at startup is unsupported, and the tests of its refusal exist."""
    repo = Path(__file__).resolve().parent.parent
    for family in FAMILIES.values():
        for feature in FEATURES:
            support = family.support(feature)
            if not support.refusal_tests:
                continue
            assert not support.supported and support.reason, f"{family.name} / {feature}"
            assert support.cell().endswith("; refused at startup"), support.cell()
            for reference in support.refusal_tests:
                path, name = reference.split("::")
                assert (repo / path).is_file(), f"{family.name} / {feature}: {path} does not exist"
                assert name in _test_names(repo / path), f"{family.name} / {feature}: no test {name} in {path}"


def test_qwen_refusals_in_the_registry() -> None:
    """qwen-image runs every DiT parallel method and refuses only VAE tiling at startup; wan-t2v supports every
    feature, A14B all but regional compilation, MagCache (its ratios index one schedule) and LoRA adapters (one
    expert or both is not settled against its pipeline yet)."""
    from dit_svc.parallel.mesh import METHOD_FLAGS

    assert FAMILIES["qwen-image"] is QWEN_IMAGE
    assert all(QWEN_IMAGE.support(feature).supported for feature in METHOD_FLAGS)
    refused = {feature for feature in FEATURES if QWEN_IMAGE.support(feature).refused_at_startup}
    assert refused == {"vae_tiling"}
    for name, expected in (("wan-t2v", []), ("wan2.2-a14b", ["compile", "mag_cache", "lora", "lora_fused"])):
        unsupported = [feature for feature in FEATURES if not FAMILIES[name].support(feature).supported]
        assert unsupported == expected, f"{name}: {unsupported}"


# ------------------------------------------------------------------------------------------- checkpoints


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


# ------------------------------------------------------------------------------------------- qwen-image e2e

QWEN_CASES = [
    # square, true CFG with a negative prompt
    dict(
        prompt="a red fox running through snow",
        negative_prompt="blurry, low quality",
        height=64,
        width=64,
        steps=2,
        guidance=4.0,
        seed=0,
    ),
    # non-square, CFG off, more steps, another seed
    dict(prompt="a lighthouse at dusk", negative_prompt="", height=48, width=80, steps=3, guidance=1.0, seed=1234),
    # tall, a negative prompt longer than the prompt (the prompt's embeddings travel padded), a seed above 2**32
    dict(
        prompt="waves",
        negative_prompt="text, watermark, jpeg artifacts, extra fingers, worst quality",
        height=80,
        width=32,
        steps=2,
        guidance=2.5,
        seed=2**40 + 5,
    ),
    # CFG with an empty negative prompt, as the pipeline runs it when negative_prompt="" is given
    dict(
        prompt="a bowl of fruit on a wooden table",
        negative_prompt="",
        height=32,
        width=48,
        steps=4,
        guidance=6.0,
        seed=7,
    ),
]


@pytest.mark.e2e
@pytest.mark.parametrize("case", QWEN_CASES, ids=[f"{c['height']}x{c['width']}-cfg{c['guidance']}" for c in QWEN_CASES])
def test_qwen_cluster_equals_qwen_image_pipeline(qwen_cluster, qwen_pipeline, case) -> None:
    _assert_close(_generate(qwen_cluster.endpoint, case), qwen_reference(qwen_pipeline, **case))


@pytest.mark.e2e
@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(num_frames=5), ["num_frames", "single images", "use 1"]),
        (dict(height=40), ["height", "multiple of 16"]),
        (dict(width=72), ["width", "multiple of 16"]),
        (dict(interp_exp=1), ["interpolation", "single images", "leave interpolation off"]),
    ],
)
def test_qwen_refuses_what_the_pipeline_cannot_make(qwen_cluster, overrides, words) -> None:
    arguments = dict(height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=0)
    with Client(qwen_cluster.endpoint) as client, pytest.raises(StageDiffError) as raised:
        client.generate("a fox", **{**arguments, **overrides})
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    for word in words:
        assert word in raised.value.message, raised.value.message


@pytest.mark.e2e
def test_qwen_defaults_and_cli_png(qwen_cluster, qwen_pipeline, tmp_path: Path) -> None:
    from PIL import Image

    out = tmp_path / "fox.png"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "stagediff.cli",
            "generate",
            "--endpoint",
            qwen_cluster.endpoint,
            "--prompt",
            "a red fox",
            "--negative-prompt",
            "blurry",
            "--seed",
            "3",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    image = np.asarray(Image.open(out).convert("RGB"))[None]
    defaults = QWEN_DEFAULT_REQUESTS["tiny"]
    expected = qwen_reference(
        qwen_pipeline,
        prompt="a red fox",
        negative_prompt="blurry",
        height=defaults["height"],
        width=defaults["width"],
        steps=defaults["num_inference_steps"],
        guidance=defaults["guidance_scale"],
        seed=3,
    )
    _assert_close(image, expected)


@pytest.mark.e2e
def test_qwen_cfg_parallel_equals_pipeline(qwen_model, qwen_pipeline, tmp_path: Path) -> None:
    case = QWEN_CASES[2]
    for cluster in _cluster(qwen_model, tmp_path, ["--cfg-parallel-size", "2"]):
        _assert_close(_generate(cluster.endpoint, case), qwen_reference(qwen_pipeline, **case))
        with Client(cluster.endpoint) as client:
            dit = next(s for s in client.cluster_info().stages if s.info.stage == "dit")
        assert dit.info.parallel_config["cfg_parallel_size"] == "2"


@pytest.mark.e2e
def test_qwen_ulysses_equals_pipeline(qwen_model, qwen_pipeline, tmp_path: Path) -> None:
    # 48x80 packs into 3x5 = 15 image tokens, which 2 does not divide (padded and masked); 80x32 runs
    # true CFG with the prompt's embeddings masked.
    for cluster in _cluster(qwen_model, tmp_path, ["--ulysses-degree", "2"]):
        for case in (QWEN_CASES[1], QWEN_CASES[2]):
            _assert_close(_generate(cluster.endpoint, case), qwen_reference(qwen_pipeline, **case))
        with Client(cluster.endpoint) as client:
            dit = next(s for s in client.cluster_info().stages if s.info.stage == "dit")
        assert dit.info.parallel_config["ulysses_degree"] == "2"


@pytest.mark.e2e
@pytest.mark.parametrize(
    "flags",
    [["--ring-degree", "2", "--tensor-parallel-size", "2"], ["--use-hsdp", "--hsdp-shard-size", "2"]],
    ids=["ring2xtp2", "hsdp2"],
)
def test_qwen_ring_tp_hsdp_equal_pipeline(qwen_model, qwen_pipeline, tmp_path: Path, flags) -> None:
    """Ring and tensor parallelism (4 ranks), HSDP (2), through the cluster: within one level of the pipeline."""
    for cluster in _cluster(qwen_model, tmp_path, flags):
        _assert_close(_generate(cluster.endpoint, QWEN_CASES[2]), qwen_reference(qwen_pipeline, **QWEN_CASES[2]))


def _qwen_ulysses_ranks(rank: int, world_size: int, config: dict, cases: list) -> list[torch.Tensor]:
    from diffusers import QwenImageTransformer2DModel

    from dit_svc.parallel import ParallelConfig, build_mesh
    from families.qwen_image.parallel import parallelize

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**config).eval()
    parallel = ParallelConfig(ulysses_degree=world_size)
    parallelize(model, parallel, build_mesh(parallel, "cpu"), torch.device("cpu"))
    with torch.no_grad():
        return [model(**inputs, return_dict=False)[0] for inputs in cases]


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_qwen_ulysses_transformer_equals_one_rank(zero_cond_t: bool) -> None:
    from diffusers import QwenImageTransformer2DModel

    from dit_svc.parallel.launch import run_ranks

    config = dict(QWEN_TRANSFORMER_CONFIGS["tiny"], zero_cond_t=zero_cond_t)
    generator = torch.Generator().manual_seed(1)
    cases = []
    # (rows, columns, text mask): 15 image tokens (padded to 16) and 16, with and without text padding
    for rows, columns, mask in ((3, 5, [1, 1, 1, 1, 1, 0, 0]), (4, 4, None), (3, 5, None)):
        shapes = [(1, rows, columns)] * (2 if zero_cond_t else 1)
        cases.append(
            dict(
                hidden_states=torch.randn(1, rows * columns * len(shapes), config["in_channels"], generator=generator),
                encoder_hidden_states=torch.randn(1, 7, config["joint_attention_dim"], generator=generator),
                encoder_hidden_states_mask=None if mask is None else torch.tensor([mask]),
                timestep=torch.tensor([0.5]),
                img_shapes=[shapes],
            )
        )
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**config).eval()
    with torch.no_grad():
        expected = [model(**inputs, return_dict=False)[0] for inputs in cases]
    for outputs in run_ranks(_qwen_ulysses_ranks, 2, config, cases):
        for output, reference in zip(outputs, expected, strict=True):
            torch.testing.assert_close(output, reference, rtol=0, atol=1e-5)


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
    import argparse

    from dit_svc.options import add_parallel_arguments
    from dit_svc.service import check_parallel_layout
    from services.stage_options import add_stage_arguments

    parser = argparse.ArgumentParser()
    add_stage_arguments(parser, default_port=0)
    add_parallel_arguments(parser)
    check_parallel_layout(parser.parse_args(["--model", str(qwen_model), "--device", "cpu", *flags]))
    # What the model cannot split is still refused, naming what would: the tiny transformer has 4 heads.
    with pytest.raises(SystemExit) as raised:
        check_parallel_layout(
            parser.parse_args(["--model", str(qwen_model), "--device", "cpu", *flags, "--ulysses-degree", "8"])
        )
    assert "4 attention heads" in str(raised.value) and "[1, 2, 4]" in str(raised.value), raised.value


def test_qwen_dit_layout_check_accepts_ulysses(qwen_model) -> None:
    import argparse

    from dit_svc.options import add_parallel_arguments
    from dit_svc.service import check_parallel_layout
    from services.stage_options import add_stage_arguments

    parser = argparse.ArgumentParser()
    add_stage_arguments(parser, default_port=0)
    add_parallel_arguments(parser)
    for flags in (["--ulysses-degree", "2"], ["--ulysses-degree", "2", "--cfg-parallel-size", "2"]):
        check_parallel_layout(parser.parse_args(["--model", str(qwen_model), "--device", "cpu", *flags]))


def _serve_refused(stage: str, model: Path, flags: list[str]) -> str:
    """`stagediff serve STAGE` with the flags; it must exit at startup with an error. Returns its stderr."""
    completed = subprocess.run(
        [sys.executable, "-m", "stagediff.cli", "serve", stage, "--model", str(model), "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode != 0, completed.stderr
    return completed.stderr


@pytest.mark.e2e
def test_qwen_vae_refuses_tiling_at_startup(qwen_model) -> None:
    stderr = _serve_refused("vae", qwen_model, ["--vae-use-tiling"])
    expected = (
        "stagediff serve vae: the qwen-image family does not support --vae-use-tiling: "
        + QWEN_IMAGE.support("vae_tiling").reason
    )
    assert expected in stderr, stderr


# ------------------------------------------------------------------------------------------- wan2.2-a14b e2e

# Two UniPC steps run 999 (>= 875: transformer) then 750 (transformer_2); four run 999, 900, 750, 500.
A14B_CASES = [
    dict(
        prompt="a red fox running through snow",
        negative_prompt="blurry, low quality",
        height=64,
        width=64,
        num_frames=9,
        steps=2,
        guidance=5.0,
        seed=0,
    ),
    dict(
        prompt="a lighthouse at dusk",
        negative_prompt="",
        height=48,
        width=80,
        num_frames=5,
        steps=4,
        guidance=1.0,
        seed=1234,
    ),
]


@pytest.mark.e2e
@pytest.mark.parametrize("case", A14B_CASES, ids=[f"{c['steps']}steps-cfg{c['guidance']}" for c in A14B_CASES])
def test_a14b_cluster_equals_wan_pipeline(a14b_cluster, a14b_pipeline, case) -> None:
    _assert_close(_generate(a14b_cluster.endpoint, case), reference_frames(a14b_pipeline, **case))


@pytest.mark.e2e
@pytest.mark.parametrize("flags", [["--ulysses-degree", "2"], ["--cfg-parallel-size", "2"]], ids=["ulysses2", "cfg2"])
def test_a14b_parallel_dit_equals_wan_pipeline(a14b_model, a14b_pipeline, tmp_path: Path, flags) -> None:
    case = A14B_CASES[0]
    for cluster in _cluster(a14b_model, tmp_path, flags):
        _assert_close(_generate(cluster.endpoint, case), reference_frames(a14b_pipeline, **case))
