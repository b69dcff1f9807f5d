"""Time per denoising step with 0, 1 and 2 LoRA adapters applied per request, against the base model and an
adapter fused at startup, side by side in one run; what an adapter's first use costs, and the cache's hits.

Three WanDenoisers of one checkpoint: the plain base (no adapter ever loaded), one with an adapter cache
(`--lora-dir`) and one with an adapter fused in (`--lora`). Each round runs the same request once per
configuration: the plain base; the cache's denoiser without adapters (PEFT's layers loaded but disabled), with
one adapter and with two; the fused one. Each configuration's median step is reported with its ratio to the
plain base. The adapters are rank-`--rank` LoRAs on every attention projection and
feed-forward linear, written by diffusers' saver (`WanPipeline.save_lora_weights`).

    python bench/lora.py [--preset small] [--steps 3] [--rounds 3] [--rank 32] [--device cuda --dtype bf16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dit_svc.denoise import denoise_request, make_adapter_cache
from dit_svc.lora import LoraSettings
from dit_svc.model_options import ModelOptions
from families.init_model import init_model
from families.wan.denoise import WanDenoiser
from families.wan.presets import DEFAULT_REQUESTS
from stagekit.denoise import DenoiseSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers.lora_adapters import wan_adapter  # noqa: E402  (the same writer as the tests)

TEXT_LENGTH = 512
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _timed_request(denoiser, adapters, spec: DenoiseSpec) -> list[float]:
    """Seconds of each step of one request."""
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
    denoise_request(denoiser, spec, conditioning, stamp, lambda: False, adapters=adapters)
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--steps", type=int, default=3, help="denoising steps per request")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every configuration")
    parser.add_argument("--rank", type=int, default=32, help="the adapters' LoRA rank")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    work = Path(tempfile.mkdtemp())
    model = init_model("wan-t2v", args.preset, work / args.preset)
    lora_dir = work / "loras"
    for seed, name in enumerate(("a", "b", "c")):
        wan_adapter(model, lora_dir / f"{name}.safetensors", seed=seed, rank=args.rank, alpha=args.rank)
    request = DEFAULT_REQUESTS[args.preset]
    spec = DenoiseSpec(
        height=request["height"],
        width=request["width"],
        num_frames=request["num_frames"],
        num_inference_steps=args.steps,
        guidance_scale=request["guidance_scale"],
        seed=0,
    )
    settings = LoraSettings(directory=lora_dir, pipeline="WanPipeline")
    plain = WanDenoiser(model, device, dtype)
    denoiser = WanDenoiser(model, device, dtype, options=ModelOptions(lora=settings))
    adapters = make_adapter_cache(denoiser, ModelOptions(lora=settings))
    fused_settings = dataclasses.replace(settings, fused=(("a", 1.0),), max_per_request=0)
    fused = WanDenoiser(model, device, dtype, options=ModelOptions(lora=fused_settings))

    # First use of each adapter: read, checked and loaded into the transformer; then a use that hits the cache.
    first_use = {}
    for name in ("a", "b", "c"):
        started = time.perf_counter()
        adapters.prepare(((name, 1.0),))
        first_use[name] = time.perf_counter() - started
    started = time.perf_counter()
    adapters.prepare((("a", 1.0),))
    hit_s = time.perf_counter() - started

    # Every configuration once per round, so that a change in the machine's load reaches them all alike.
    configurations = {
        "base": (plain, None, ()),
        "base_adapters_loaded": (denoiser, adapters, ()),
        "one": (denoiser, adapters, (("a", 1.0),)),
        "two": (denoiser, adapters, (("a", 1.0), ("b", 0.5))),
        "fused": (fused, None, ()),
    }
    for runner, cache, loras in configurations.values():  # warm-up
        _timed_request(runner, cache, dataclasses.replace(spec, loras=loras))
    steps: dict[str, list[float]] = {name: [] for name in configurations}
    for _ in range(args.rounds):
        for name, (runner, cache, loras) in configurations.items():
            steps[name] += _timed_request(runner, cache, dataclasses.replace(spec, loras=loras))
    medians = {name: statistics.median(values) for name, values in steps.items()}
    tokens = ((spec.num_frames - 1) // 4 + 1) * (spec.height // 16) * (spec.width // 16)
    print(
        json.dumps(
            {
                "benchmark": "lora",
                "preset": args.preset,
                "request": {
                    "height": spec.height,
                    "width": spec.width,
                    "num_frames": spec.num_frames,
                    "video_tokens": tokens,
                    "text_tokens": TEXT_LENGTH,
                    "steps": args.steps,
                    "rounds": args.rounds,
                },
                "adapter": {
                    "rank": args.rank,
                    "file_bytes": (lora_dir / "a.safetensors").stat().st_size,
                    "loaded_bytes": adapters.loaded_bytes // len(adapters.loaded),
                },
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "step_s": {name: round(value, 4) for name, value in medians.items()},
                "step_ratio_to_base": {name: round(value / medians["base"], 3) for name, value in medians.items()},
                "first_use_s": {name: round(value, 4) for name, value in first_use.items()},
                "cache_hit_s": round(hit_s, 5),
                "cache": {"hits": adapters.hits, "misses": adapters.misses, "loaded": list(adapters.loaded)},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
