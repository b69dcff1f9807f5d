"""Time per denoising step of the DiT eager and with regional compilation (`--compile`), on 1 rank and on
2 gloo ranks under Ulysses, side by side in one run, and what the first compiled request costs.

Each layout builds two WanDenoisers as the DiT stage does, one of them compiled, and runs the same request
`--requests` + 1 times on each: the first request is timed whole (on the compiled one it is the request that
compiles the blocks), then eager and compiled requests alternate, timed step by step, and the median step is
reported. Every rank gets one intra-op thread, as in bench/dit_scaling.py; inductor compiles its kernels in
worker processes on whatever cores are free.

    python bench/compile.py [--preset small] [--steps 3] [--requests 3]
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
from torch._dynamo.utils import counters

from dit_svc.compile import compile_repeated_blocks
from families.init_model import init_model
from families.wan.denoise import WanDenoiser
from families.wan.presets import DEFAULT_REQUESTS
from stagekit.denoise import DenoiseSpec
from stagekit.parallel import ParallelConfig
from stagekit.parallel.launch import run_ranks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TEXT_LENGTH = 512


def _spec(preset: str, steps: int, size: tuple[int, int, int] | None) -> DenoiseSpec:
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


def _timed_request(denoiser: WanDenoiser, spec: DenoiseSpec) -> tuple[float, list[float]]:
    """Seconds of the whole request and of each of its steps."""
    generator = torch.Generator().manual_seed(0)
    conditioning = {
        "prompt_embeds": torch.randn(1, TEXT_LENGTH, denoiser.text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, TEXT_LENGTH, denoiser.text_dim, generator=generator),
    }
    cuda = denoiser.device.type == "cuda"

    def stamp(*_) -> None:
        if cuda:  # a step's kernels are queued: wait for them before reading the clock
            torch.cuda.synchronize(denoiser.device)
        stamps.append(time.perf_counter())

    stamps: list[float] = []
    stamp()
    denoiser.denoise(spec, conditioning, on_step=stamp, cancelled=lambda: False)
    return stamps[-1] - stamps[0], [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def _summary(first_request_s: float, requests: list[tuple[float, list[float]]]) -> dict:
    return {
        "first_request_s": round(first_request_s, 3),
        "request_s": round(statistics.median(seconds for seconds, _ in requests), 3),
        "step_s": round(statistics.median(step for _, steps in requests for step in steps), 3),
    }


def _eager_and_compiled(
    rank: int, world_size: int, model: str, spec: DenoiseSpec, requests: int, device: str = "cpu", dtype: str = "fp32"
) -> dict:
    """One layout's eager and compiled figures on this rank (1 rank when world_size is 1).

    After each one's first request, eager and compiled requests alternate, so that a change in the
    machine's load reaches both alike.
    """
    parallel = ParallelConfig(ulysses_degree=2) if world_size == 2 else None
    eager = WanDenoiser(model, torch.device(device), DTYPES[dtype], parallel=parallel)
    compiled = WanDenoiser(model, torch.device(device), DTYPES[dtype], parallel=parallel)
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    blocks = compile_repeated_blocks(compiled.experts)
    eager_first, _ = _timed_request(eager, spec)
    compiled_first, _ = _timed_request(compiled, spec)
    eager_requests, compiled_requests = [], []
    for _ in range(requests):
        eager_requests.append(_timed_request(eager, spec))
        compiled_requests.append(_timed_request(compiled, spec))
    eager_summary = _summary(eager_first, eager_requests)
    compiled_summary = _summary(compiled_first, compiled_requests)
    compiled_summary["blocks"] = blocks
    compiled_summary["graphs"] = counters["stats"]["unique_graphs"] - graphs_before
    return {
        "eager": eager_summary,
        "compiled": compiled_summary,
        # The first compiled request beyond a compiled request that compiles nothing.
        "compile_s": round(compiled_summary["first_request_s"] - compiled_summary["request_s"], 3),
        "step_speedup": round(eager_summary["step_s"] / compiled_summary["step_s"], 2),
        "first_request_ratio": round(compiled_summary["first_request_s"] / eager_summary["first_request_s"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--model", help="existing checkpoint (default: make one with init-model)")
    parser.add_argument("--steps", type=int, default=3, help="denoising steps per request")
    parser.add_argument("--requests", type=int, default=3, help="timed requests after the first")
    parser.add_argument("--size", type=int, nargs=3, metavar=("H", "W", "FRAMES"), help="default: the preset's")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (one rank only)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    args = parser.parse_args()
    model = args.model or str(init_model("wan-t2v", args.preset, Path(tempfile.mkdtemp()) / args.preset))
    spec = _spec(args.preset, args.steps, tuple(args.size) if args.size else None)

    torch.set_num_threads(1)
    one_rank = _eager_and_compiled(0, 1, model, spec, args.requests, args.device, args.dtype)
    # Ranks run in lockstep: rank 0's times are the group's. The gloo ranks are CPU ranks.
    ulysses2 = run_ranks(_eager_and_compiled, 2, model, spec, args.requests)[0] if args.device == "cpu" else None
    tokens = ((spec.num_frames - 1) // 4 + 1) * (spec.height // 16) * (spec.width // 16)
    print(
        json.dumps(
            {
                "benchmark": "compile",
                "preset": args.preset,
                "request": {
                    "height": spec.height,
                    "width": spec.width,
                    "num_frames": spec.num_frames,
                    "video_tokens": tokens,
                    "text_tokens": TEXT_LENGTH,
                    "guidance_scale": spec.guidance_scale,
                    "steps": spec.num_inference_steps,
                    "timed_requests": args.requests,
                },
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                "dtype": args.dtype,
                "backend": "inductor (Triton on CUDA)" if args.device.startswith("cuda") else "inductor (C++ on CPU)",
                "threads_per_rank": 1,
                "one_rank": one_rank,
                "ulysses2": ulysses2,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
