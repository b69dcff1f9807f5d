"""Every parallel layout of the DiT gives the final latents of one rank (gloo, 2 and 4 ranks)."""

from __future__ import annotations

import pytest
import torch

from families.wan.denoise import WanDenoiser
from stagekit.denoise import DenoiseSpec
from stagekit.parallel import ParallelConfig
from stagekit.parallel.launch import run_ranks

TOLERANCE = 1e-4


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
    ("ulysses4", ParallelConfig(ulysses_degree=4)),
    ("ring4", ParallelConfig(ring_degree=4)),
    ("usp2x2", ParallelConfig(ulysses_degree=2, ring_degree=2)),
    ("ulysses2xcfg2", ParallelConfig(ulysses_degree=2, cfg_degree=2)),
    ("ring2xcfg2", ParallelConfig(ring_degree=2, cfg_degree=2)),
    ("tp2xcfg2", ParallelConfig(tp_degree=2, cfg_degree=2)),
    (
        "hsdp2x2xulysses2xcfg2",
        ParallelConfig(ulysses_degree=2, cfg_degree=2, use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2),
    ),
]


# Token counts: 64x64x9 -> 3 x 4 x 4 = 48 tokens; 48x80x5 -> 2 x 3 x 5 = 30 tokens (not divisible by 4).
SPECS = [
    DenoiseSpec(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0, seed=0),
    DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=1),
]


def _conditioning(seed: int, text_dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
    }


def _latents(denoiser: WanDenoiser, spec: DenoiseSpec) -> torch.Tensor:
    conditioning = _conditioning(spec.seed, denoiser.text_dim)
    return denoiser.denoise(spec, conditioning, on_step=lambda s, t: None, cancelled=lambda: False)


def _run_layouts(rank: int, world_size: int, model_dir: str, layouts) -> dict[str, list[torch.Tensor]]:
    results = {}
    for name, config in layouts:
        denoiser = WanDenoiser(model_dir, torch.device("cpu"), torch.float32, parallel=config)
        results[name] = [_latents(denoiser, spec) for spec in SPECS]
    return results


@pytest.fixture(scope="module")
def single_rank_latents(tiny_model) -> list[torch.Tensor]:
    denoiser = WanDenoiser(tiny_model, torch.device("cpu"), torch.float32)
    return [_latents(denoiser, spec) for spec in SPECS]


@pytest.mark.parametrize(("world_size", "layouts"), [(2, LAYOUTS_2), (4, LAYOUTS_4)], ids=["2-ranks", "4-ranks"])
def test_parallel_latents_equal_one_rank(tiny_model, single_rank_latents, world_size, layouts) -> None:
    per_rank = run_ranks(_run_layouts, world_size, str(tiny_model), layouts)
    report = []
    for name, _ in layouts:
        for rank, results in enumerate(per_rank):
            for spec, expected, actual in zip(SPECS, single_rank_latents, results[name], strict=True):
                difference = (actual - expected).abs().max().item()
                report.append((name, rank, f"{spec.height}x{spec.width}x{spec.num_frames}", difference))
    worst = max(report, key=lambda row: row[3])
    print("\n".join(f"{name} rank {rank} {size}: max abs diff {diff:.2e}" for name, rank, size, diff in report))
    assert worst[3] <= TOLERANCE, f"{worst[0]} rank {worst[1]} at {worst[2]}: max abs difference {worst[3]:.2e}"
