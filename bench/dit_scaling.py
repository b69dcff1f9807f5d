"""Time per denoising step of the DiT at 1 rank and 2 ranks, for each parallel method, side by side in one run.

Every rank gets one intra-op thread, so 2 ranks use the cores 1 rank leaves idle.
The 1-rank baseline and every 2-rank layout run the same request (the small
preset's, CFG on) on the same checkpoint; the first step of each run is a
warm-up and is not counted. diffusers' own Ulysses context parallelism is tried
on the same model and ranks; where it cannot run (it needs an accelerator), the
JSON says why instead of giving a number.

    python bench/dit_scaling.py --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from families.init_model import init_model
from families.wan.denoise import WanDenoiser
from families.wan.presets import DEFAULT_REQUESTS
from stagekit.denoise import DenoiseSpec
from stagekit.parallel import ParallelConfig
from stagekit.parallel.launch import run_ranks

LAYOUTS = {
    "ulysses2": ParallelConfig(ulysses_degree=2),
    "ring2": ParallelConfig(ring_degree=2),
    "cfg2": ParallelConfig(cfg_degree=2),
    "tp2": ParallelConfig(tp_degree=2),
}


def _spec(preset: str, steps: int, size: tuple[int, int, int] | None = None) -> DenoiseSpec:
    request = DEFAULT_REQUESTS[preset]
    height, width, num_frames = size or (request["height"], request["width"], request["num_frames"])
    return DenoiseSpec(
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=steps,
        guidance_scale=request["guidance_scale"],
        seed=0,
    )


def _step_seconds(denoiser: WanDenoiser, spec: DenoiseSpec) -> list[float]:
    """Seconds of each step after the first."""
    generator = torch.Generator().manual_seed(0)
    conditioning = {
        "prompt_embeds": torch.randn(1, 512, denoiser.text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 512, denoiser.text_dim, generator=generator),
    }
    stamps = [time.perf_counter()]
    denoiser.denoise(
        spec, conditioning, on_step=lambda s, t: stamps.append(time.perf_counter()), cancelled=lambda: False
    )
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]


def _ours(rank: int, world_size: int, model: str, spec: DenoiseSpec, layouts: list[str]) -> dict:
    results = {}
    for name in layouts:
        denoiser = WanDenoiser(model, torch.device("cpu"), torch.float32, parallel=LAYOUTS[name])
        results[name] = _step_seconds(denoiser, spec)
    return results


def _diffusers_ulysses(rank: int, world_size: int, model: str, spec: DenoiseSpec) -> dict:
    """diffusers' context parallelism on the same model, or the reason it does not run here."""
    from diffusers import ContextParallelConfig

    denoiser = WanDenoiser(model, torch.device("cpu"), torch.float32)
    try:
        denoiser.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world_size))
        return {"seconds": _step_seconds(denoiser, spec)}
    except Exception as error:  # recorded in the output: the comparison is "where it runs"
        return {"error": f"{type(error).__name__}: {error}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--model", help="existing checkpoint (default: make one with init-model)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per run (the first is warm-up)")
    parser.add_argument("--size", type=int, nargs=3, metavar=("H", "W", "FRAMES"), help="default: the preset's")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    model = args.model or str(init_model("wan-t2v", args.preset, Path(tempfile.mkdtemp()) / args.preset))
    spec = _spec(args.preset, args.steps, tuple(args.size) if args.size else None)

    torch.set_num_threads(1)
    single = _step_seconds(WanDenoiser(model, torch.device("cpu"), torch.float32), spec)
    per_rank = run_ranks(_ours, 2, model, spec, args.layouts)
    theirs = run_ranks(_diffusers_ulysses, 2, model, spec)[0]

    one_rank = statistics.median(single)
    layouts = {}
    for name in args.layouts:
        # A step ends when the slowest rank ends it; ranks run in lockstep, so rank 0's time is the step's.
        seconds = statistics.median(per_rank[0][name])
        layouts[name] = {"step_s": round(seconds, 3), "speedup": round(one_rank / seconds, 2)}
    if "seconds" in theirs:
        seconds = statistics.median(theirs["seconds"])
        layouts["diffusers_ulysses2"] = {"step_s": round(seconds, 3), "speedup": round(one_rank / seconds, 2)}
    else:
        layouts["diffusers_ulysses2"] = {"did_not_run": theirs["error"]}
    tokens = ((spec.num_frames - 1) // 4 + 1) * (spec.height // 16) * (spec.width // 16)
    print(
        json.dumps(
            {
                "benchmark": "dit_scaling",
                "preset": args.preset,
                "request": {
                    "height": spec.height,
                    "width": spec.width,
                    "num_frames": spec.num_frames,
                    "video_tokens": tokens,
                    "guidance_scale": spec.guidance_scale,
                    "timed_steps": args.steps - 1,
                },
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "threads_per_rank": 1,
                "one_rank_step_s": round(one_rank, 3),
                "two_ranks": layouts,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
