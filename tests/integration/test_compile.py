"""Regional compilation (`--compile`, dit_svc/compile.py): compiled blocks compute what eager ones do.

Each test builds the family's denoiser as the DiT stage does, runs four requests eagerly, compiles the
blocks and runs the same four again: Wan and Qwen-Image on one rank, and Wan on two gloo ranks under
Ulysses and under HSDP (whose FSDP2-wrapped blocks are why the blocks are matched along their class
hierarchy). Inductor compiles on CPU with g++, so these are the CPU path of the flag. The latents must
equal eager ones within fp32 tolerance, eager computed by the same denoiser before compiling.

The first two requests bring every variant of structure that dynamo compiles (with and without
sequence-parallel padding, Qwen-Image's branches with and without a text mask); the last two have sizes
and text lengths not seen before, and must compile nothing more: recompilation is bounded by structure,
not by request size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from dit_svc.compile import compile_repeated_blocks, repeated_blocks
from dit_svc.config import DenoiserBuild, DitConfig
from dit_svc.denoise import make_denoiser
from dit_svc.model_options import ModelOptions
from families.init_model import init_model
from families.qwen_image.denoise import QwenImageDenoiser
from families.registry import FAMILIES as REGISTRY
from families.wan.denoise import WanDenoiser
from stagekit.denoise import DenoiseSpec
from stagekit.parallel import ParallelConfig
from stagekit.parallel.launch import run_ranks
from tests.helpers.serving import parse_serve

TOLERANCE = 1e-4
CPU = torch.device("cpu")
FAMILIES = ["wan-t2v", "qwen-image"]
DENOISERS = {"wan-t2v": WanDenoiser, "qwen-image": QwenImageDenoiser}
CHECKPOINT_FIXTURES = {"wan-t2v": "tiny_model", "qwen-image": "qwen_model"}
LAYOUTS_2 = [
    ("ulysses2", ParallelConfig(ulysses_degree=2)),
    ("hsdp2", ParallelConfig(use_hsdp=True, hsdp_shard_size=2)),
]
# Requests the first two of which compile. Wan tokens: 48x80x5 -> 2 x 3 x 5 = 30, 48x48x9 -> 3 x 3 x 3 = 27
# (padded under Ulysses 2), then 64x64x5 -> 32 and 48x80x9 -> 45 (padded), with a shorter text.
WAN_REQUESTS = [
    (DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=1), 24),
    (DenoiseSpec(height=48, width=48, num_frames=9, num_inference_steps=2, guidance_scale=4.0, seed=2), 24),
    (DenoiseSpec(height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=3), 17),
    (DenoiseSpec(height=48, width=80, num_frames=9, num_inference_steps=2, guidance_scale=4.0, seed=4), 17),
]
# Qwen-Image image tokens: 64x64 -> 16, 48x80 -> 15 (padded), then 32x96 -> 12 and 80x48 -> 15 (padded). The
# (prompt, negative prompt) masks: a hole keeps a mask, an all-ones one is dropped, so both kinds reach the blocks.
QWEN_REQUESTS = [
    (
        DenoiseSpec(height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=1),
        ([1, 1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]),
    ),
    (
        DenoiseSpec(height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=3.0, seed=2),
        ([1, 1, 1, 1, 1, 0, 0, 0, 0], [1, 0, 1, 1, 1, 1, 1, 1, 0]),
    ),
    (
        DenoiseSpec(height=32, width=96, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=3),
        ([1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]),
    ),
    (
        DenoiseSpec(height=80, width=48, num_frames=1, num_inference_steps=2, guidance_scale=3.0, seed=4),
        ([1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 1, 1, 0]),
    ),
]
COMPILING_REQUESTS = 2
# The families whose feature table says --compile is not verified: the stage must refuse it for them.
UNVERIFIED = [name for name, family in REGISTRY.items() if not family.support("compile").supported]


def _conditioning(family: str, index: int, text_dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    if family == "wan-t2v":
        length = WAN_REQUESTS[index][1]
        return {
            "prompt_embeds": torch.randn(1, length, text_dim, generator=generator),
            "negative_prompt_embeds": torch.randn(1, length, text_dim, generator=generator),
        }
    prompt_mask, negative_mask = QWEN_REQUESTS[index][1]
    return {
        "prompt_embeds": torch.randn(1, len(prompt_mask), text_dim, generator=generator),
        "prompt_embeds_mask": torch.tensor([prompt_mask]),
        "negative_prompt_embeds": torch.randn(1, len(negative_mask), text_dim, generator=generator),
        "negative_prompt_embeds_mask": torch.tensor([negative_mask]),
    }


def _eager_then_compiled(family: str, model_dir: str, parallel: ParallelConfig | None) -> dict:
    """Every request's latents eager and compiled, and the graphs dynamo had compiled after each compiled one."""
    torch._dynamo.reset()
    denoiser = DENOISERS[family](model_dir, CPU, torch.float32, parallel=parallel)
    specs = [spec for spec, _ in (WAN_REQUESTS if family == "wan-t2v" else QWEN_REQUESTS)]

    def denoise(index: int) -> torch.Tensor:
        conditioning = _conditioning(family, index, denoiser.text_dim)
        return denoiser.denoise(specs[index], conditioning, on_step=lambda s, t: None, cancelled=lambda: False)

    eager = [denoise(index) for index in range(len(specs))]
    blocks = compile_repeated_blocks(denoiser.experts)
    graphs_before = counters["stats"]["unique_graphs"]
    compiled, graphs = [], []
    for index in range(len(specs)):
        compiled.append(denoise(index))
        graphs.append(counters["stats"]["unique_graphs"] - graphs_before)
    return {"blocks": blocks, "eager": eager, "compiled": compiled, "graphs": graphs}


def _wan_layouts_on_rank(rank: int, world_size: int, model_dir: str) -> dict:
    return {name: _eager_then_compiled("wan-t2v", model_dir, config) for name, config in LAYOUTS_2}


@pytest.fixture(scope="module", params=FAMILIES)
def one_rank(request: pytest.FixtureRequest) -> tuple[str, dict]:
    model_dir = request.getfixturevalue(CHECKPOINT_FIXTURES[request.param])
    return request.param, _eager_then_compiled(request.param, str(model_dir), None)


@pytest.fixture(scope="module")
def wan_two_ranks(tiny_model: Path) -> list[dict]:
    return run_ranks(_wan_layouts_on_rank, 2, str(tiny_model))


def _max_differences(result: dict) -> list[float]:
    return [
        (compiled - eager).abs().max().item()
        for compiled, eager in zip(result["compiled"], result["eager"], strict=True)
    ]


def _compiles_nothing_more(graphs: list[int]) -> bool:
    """The graphs compiled after each request stay at what the first COMPILING_REQUESTS ones brought."""
    return all(count == graphs[COMPILING_REQUESTS - 1] for count in graphs[COMPILING_REQUESTS:])


def test_compiled_blocks_equal_eager_on_one_rank(one_rank) -> None:
    family, result = one_rank
    # The tiny presets have two blocks, and one transformer each.
    assert result["blocks"] == 2
    assert result["graphs"][0] > 0, "nothing was compiled"
    assert all(eager.abs().max() > 0.1 for eager in result["eager"])
    differences = _max_differences(result)
    print(f"{family} one rank: max abs diff per request {differences}, graphs {result['graphs']}")
    assert max(differences) <= TOLERANCE, differences


def test_new_request_sizes_compile_nothing_more(one_rank) -> None:
    """Once the first requests brought every variant of structure, new sizes and text lengths reuse the graphs."""
    family, result = one_rank
    assert _compiles_nothing_more(result["graphs"]), f"{family}: graphs after each request {result['graphs']}"


def test_compiled_blocks_equal_eager_under_ulysses_and_hsdp(wan_two_ranks) -> None:
    """The same on every rank of Wan under Ulysses 2 (padded and unpadded token counts) and HSDP 2, where
    new sizes compile nothing more either."""
    for rank, layouts in enumerate(wan_two_ranks):
        for layout, result in layouts.items():
            differences = _max_differences(result)
            print(f"wan-t2v {layout} rank {rank}: max abs diff per request {differences}, graphs {result['graphs']}")
            assert result["blocks"] == 2 and result["graphs"][0] > 0, (layout, rank, result["blocks"])
            assert max(differences) <= TOLERANCE, (layout, rank, differences)
            assert _compiles_nothing_more(result["graphs"]), (layout, rank, result["graphs"])


def test_compile_flag_reaches_the_denoiser(tiny_model) -> None:
    """`stagediff serve dit --compile` sets the option, GetClusterInfo reports it, and the stage's
    make_denoiser wraps every block for compilation (each compiles on its first call)."""
    options = DitConfig.from_args(parse_serve(["dit", "--model", str(tiny_model), "--compile"])).options
    assert options.compile and options.describe()["compile"] == "regional"
    assert not DitConfig.from_args(parse_serve(["dit", "--model", str(tiny_model)])).options.compile
    denoiser = make_denoiser(tiny_model, CPU, torch.float32, DenoiserBuild(options=options))
    blocks = repeated_blocks(denoiser.transformer)
    assert len(blocks) == 2 and all(block._compiled_call_impl is not None for block in blocks)
    eager = make_denoiser(tiny_model, CPU, torch.float32, DenoiserBuild(options=ModelOptions()))
    assert all(block._compiled_call_impl is None for block in repeated_blocks(eager.transformer))


@pytest.mark.parametrize("name", UNVERIFIED)
def test_compile_is_refused_at_startup_where_unverified(tmp_path_factory, name: str) -> None:
    support = REGISTRY[name].support("compile")
    assert support.refused_at_startup
    model_dir = init_model(name, "tiny", tmp_path_factory.mktemp("models") / name, seed=0)
    with pytest.raises(SystemExit) as refused:
        DitConfig.from_args(parse_serve(["dit", "--model", str(model_dir), "--compile"]))
    assert f"the {name} family does not support --compile: {support.reason}" in str(refused.value)
