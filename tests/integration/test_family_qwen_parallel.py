"""Qwen-Image: every parallel layout of the DiT gives the final latents of one rank (gloo, 2 and 4 ranks).

QwenImageDenoiser, as the DiT stage serves it, runs on the tiny checkpoint with random conditioning under
Ring, Ulysses, USP, tensor parallelism, HSDP and CFG-parallel, alone and combined; the latents of every
rank must equal the single-rank denoiser's. The sizes include an image token count (15) that no degree
divides, and the texts have different lengths and padding inside their masks, so that both the image
and the text padding reach the joint attention. One transformer forward per layout also compares the
text stream each block returns, which every rank computes whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from families.qwen_image.denoise import QwenImageDenoiser
from stagekit.denoise import DenoiseSpec
from stagekit.parallel import ParallelConfig
from stagekit.parallel.launch import run_ranks

TOLERANCE = 1e-4
CPU = torch.device("cpu")

# (name, config). Each world size runs in one spawned group; every layout builds its own mesh in it.
LAYOUTS_2 = [
    ("ulysses2", ParallelConfig(ulysses_degree=2)),
    ("ring2", ParallelConfig(ring_degree=2)),
    ("cfg2", ParallelConfig(cfg_degree=2)),
    ("tp2", ParallelConfig(tp_degree=2)),
    ("hsdp2", ParallelConfig(use_hsdp=True, hsdp_shard_size=2)),
    ("hsdp2xulysses2", ParallelConfig(ulysses_degree=2, use_hsdp=True, hsdp_shard_size=2)),
]
LAYOUTS_4 = [
    ("usp2x2", ParallelConfig(ulysses_degree=2, ring_degree=2)),
    ("ring2xcfg2", ParallelConfig(ring_degree=2, cfg_degree=2)),
    ("tp2xcfg2", ParallelConfig(tp_degree=2, cfg_degree=2)),
    ("tp2xring2", ParallelConfig(tp_degree=2, ring_degree=2)),
    ("hsdp4xulysses2xring2", ParallelConfig(ulysses_degree=2, ring_degree=2, use_hsdp=True, hsdp_shard_size=4)),
    (
        "hsdp2x2xulysses2xcfg2",
        ParallelConfig(ulysses_degree=2, cfg_degree=2, use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2),
    ),
]
# Layouts whose ranks hold only part of the weights, and so read only part of the checkpoint.
SHARDED = {"tp2", "hsdp2", "hsdp2xulysses2", "tp2xcfg2", "tp2xring2", "hsdp4xulysses2xring2", "hsdp2x2xulysses2xcfg2"}
# Packed image tokens: 64x64 -> 4 x 4 = 16; 48x80 -> 3 x 5 = 15 (divisible by neither 2 nor 4). Both with true CFG.
SPECS = [
    DenoiseSpec(height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=0),
    DenoiseSpec(height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=3.0, seed=1),
]
# Per spec, the (prompt, negative prompt) masks as the text encoder sends them: both texts padded to the longer
# one. A hole in a mask keeps it after the trailing padding is dropped, so it reaches the transformer.
MASKS = [
    ([1, 1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]),
    ([1, 1, 1, 1, 1, 0, 0, 0, 0], [1, 0, 1, 1, 1, 1, 1, 1, 0]),
]


def _conditioning(spec_index: int, dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(spec_index)
    prompt_mask, negative_mask = MASKS[spec_index]
    return {
        "prompt_embeds": torch.randn(1, len(prompt_mask), dim, generator=generator),
        "prompt_embeds_mask": torch.tensor([prompt_mask]),
        "negative_prompt_embeds": torch.randn(1, len(negative_mask), dim, generator=generator),
        "negative_prompt_embeds_mask": torch.tensor([negative_mask]),
    }


def _forward_inputs(dim: int, in_channels: int) -> dict:
    """One transformer forward: 15 image tokens and a masked text."""
    generator = torch.Generator().manual_seed(7)
    return dict(
        hidden_states=torch.randn(1, 15, in_channels, generator=generator),
        encoder_hidden_states=torch.randn(1, 9, dim, generator=generator),
        encoder_hidden_states_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 0, 0]]),
        timestep=torch.tensor([0.5]),
        img_shapes=[[(1, 3, 5)]],
    )


def _outputs(denoiser: QwenImageDenoiser) -> dict:
    """The latents of every spec, and the image output and every block's text output of one forward."""
    from stagekit.parallel.hsdp import local_parameter_bytes
    from stagekit.weights import load_stats

    latents = []
    for index, spec in enumerate(SPECS):
        conditioning = _conditioning(index, denoiser.text_dim)
        latents.append(denoiser.denoise(spec, conditioning, on_step=lambda s, t: None, cancelled=lambda: False))
    transformer = denoiser.transformer
    texts: list[torch.Tensor] = []
    handles = [
        block.register_forward_hook(lambda module, args, output: texts.append(output[0].clone()))
        for block in transformer.transformer_blocks
    ]
    inputs = _forward_inputs(denoiser.text_dim, transformer.config.in_channels)
    with torch.no_grad():
        image = transformer(**inputs, return_dict=False)[0]
    for handle in handles:
        handle.remove()
    return {
        "latents": latents,
        "image": image,
        "texts": texts,
        "bytes_held": local_parameter_bytes(transformer),
        "bytes_read": load_stats(transformer).total_bytes,
    }


def _run_layouts(rank: int, world_size: int, model_dir: str, layouts) -> dict[str, dict]:
    return {
        name: _outputs(QwenImageDenoiser(model_dir, CPU, torch.float32, parallel=config)) for name, config in layouts
    }


@pytest.fixture(scope="module")
def one_rank(qwen_model: Path) -> dict:
    return _outputs(QwenImageDenoiser(qwen_model, CPU, torch.float32))


@pytest.fixture(scope="module")
def two_ranks(qwen_model: Path) -> list[dict]:
    return run_ranks(_run_layouts, 2, str(qwen_model), LAYOUTS_2)


@pytest.fixture(scope="module")
def four_ranks(qwen_model: Path) -> list[dict]:
    return run_ranks(_run_layouts, 4, str(qwen_model), LAYOUTS_4)


GROUPS = pytest.mark.parametrize(
    ("group", "layouts"), [("two_ranks", LAYOUTS_2), ("four_ranks", LAYOUTS_4)], ids=["2-ranks", "4-ranks"]
)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"{tuple(a.shape)} != {tuple(b.shape)}"
    return (a - b).abs().max().item()


@GROUPS
def test_qwen_parallel_latents_equal_one_rank(request, one_rank: dict, group: str, layouts) -> None:
    per_rank = request.getfixturevalue(group)
    assert all(latents.abs().max() > 0.1 for latents in one_rank["latents"])
    report = []
    for name, _ in layouts:
        for rank, results in enumerate(per_rank):
            result = results[name]
            for spec, expected, actual in zip(SPECS, one_rank["latents"], result["latents"], strict=True):
                report.append((name, rank, f"latents {spec.height}x{spec.width}", _max_diff(actual, expected)))
            report.append((name, rank, "forward image", _max_diff(result["image"], one_rank["image"])))
            for block, (expected, actual) in enumerate(zip(one_rank["texts"], result["texts"], strict=True)):
                report.append((name, rank, f"forward text of block {block}", _max_diff(actual, expected)))
    print("\n".join(f"{name} rank {rank} {what}: max abs diff {diff:.2e}" for name, rank, what, diff in report))
    worst = max(report, key=lambda row: row[3])
    assert worst[3] <= TOLERANCE, f"{worst[0]} rank {worst[1]} {worst[2]}: max abs difference {worst[3]:.2e}"


@GROUPS
def test_qwen_sharded_layouts_read_and_hold_part_of_the_weights(request, one_rank: dict, group: str, layouts) -> None:
    """Tensor parallelism and HSDP load shard-wise: each rank reads and keeps less than the whole transformer."""
    per_rank = request.getfixturevalue(group)
    for name, _ in layouts:
        for rank, results in enumerate(per_rank):
            held, read = results[name]["bytes_held"], results[name]["bytes_read"]
            print(f"{name} rank {rank}: holds {held} of {one_rank['bytes_held']} bytes, read {read}")
            if name in SHARDED:
                assert held < 0.8 * one_rank["bytes_held"], f"{name} rank {rank}: holds {held} bytes"
                assert read < 0.8 * one_rank["bytes_read"], f"{name} rank {rank}: read {read} bytes"
            else:
                assert held == one_rank["bytes_held"], f"{name} rank {rank}: holds {held} bytes"
