"""Step caches side by side in one run: how many transformer passes each method and threshold skips, the
denoising time it saves, how far its frames move from the uncached ones, and what the demo model draws.

Two parts, each against its own uncached run in the same process:
- speed, on a random-weight preset (`--preset small`): per method and threshold, the fraction of passes
  skipped, the denoising seconds and the fraction of time saved, the ratio of the two (1.0 when a skipped
  pass costs exactly a pass and the cache itself costs nothing), and the PSNR of the decoded frames against
  the uncached frames;
- quality, on the trained demo model (shapeworld/checkpoint) with the real embeddings of `--cases` prompts
  of its evaluation set: the fraction of videos that show every attribute their prompt asks for
  (shapeworld/score.py), and the passes skipped.

MagCache's ratios are calibrated first on a different seed and prompt than the ones measured, as
`stagediff calibrate-cache` does for a deployment. Prints JSON.

    python bench/step_cache.py [--preset small] [--steps 20] [--cases 24] [--skip-quality]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

# bench/ is the script's directory: the quality and PSNR helpers of the quantization benchmark.
from quantization import prompt_conditioning, psnr, quality, random_conditioning

from dit_svc.denoise import denoise_request
from families.init_model import init_model
from families.wan.decode import WanStreamingDecoder
from families.wan.denoise import WanDenoiser
from families.wan.presets import DEFAULT_REQUESTS
from shapeworld.demo_model import CHECKPOINT as DEMO_CHECKPOINT
from shapeworld.demo_model import DEFAULT_REQUEST as DEMO_REQUEST
from shapeworld.evaluation import evaluation_set
from stagekit.denoise import CacheSpec, DenoiseSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
THRESHOLDS = {
    "first_block": (0.05, 0.1, 0.2, 0.3),
    "teacache": (0.05, 0.1, 0.2, 0.3),
    "mag": (0.03, 0.06, 0.12, 0.24),
}


def spec_of(request: dict, steps: int) -> DenoiseSpec:
    return DenoiseSpec(
        height=request["height"],
        width=request["width"],
        num_frames=request["num_frames"],
        num_inference_steps=steps,
        guidance_scale=request["guidance_scale"],
        seed=0,
    )


def calibrate(denoiser: WanDenoiser, spec: DenoiseSpec, conditioning: dict) -> dict[str, list[float]]:
    """MagCache's ratios of the prompt branch, from one request that runs every pass."""
    calibration: dict = {}
    calibrating = replace(spec, seed=spec.seed + 1000, cache=CacheSpec("mag", 1.0))
    with contextlib.redirect_stdout(sys.stderr):  # diffusers prints the ratios; stdout is the report
        denoise_request(denoiser, calibrating, conditioning, lambda s, t: None, lambda: False, calibration=calibration)
    return {expert: branches["cond"] for expert, branches in calibration.items()}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(denoiser, decoder, spec, cache, conditionings, seeds, mag_ratios, repeats: int = 1) -> dict:
    """Videos of every conditioning with `cache`, the median denoising seconds over `repeats`, the passes."""
    videos, seconds, run_passes, skipped = [], [], 0, 0
    for conditioning, seed in zip(conditionings, seeds, strict=True):
        request = replace(spec, seed=seed, cache=cache)
        times = []
        for _ in range(repeats):
            synchronize(denoiser.device)
            started = time.perf_counter()
            latents, passes = denoise_request(
                denoiser, request, conditioning, lambda s, t: None, lambda: False, mag_ratios=mag_ratios
            )
            synchronize(denoiser.device)
            times.append(time.perf_counter() - started)
        seconds.append(statistics.median(times))
        run_passes, skipped = run_passes + passes.run, skipped + passes.skipped
        session = decoder.session()
        latents = latents.float()
        frames = [session.decode_next(latents[:, :, t : t + 1]).cpu() for t in range(latents.shape[2])]
        videos.append(torch.cat(frames))
    return {"videos": videos, "frames": torch.cat(videos), "denoise_s": sum(seconds), "passes": (run_passes, skipped)}


def caches() -> list[CacheSpec]:
    return [CacheSpec(method, threshold) for method, values in THRESHOLDS.items() for threshold in values]


def speed(model: Path, spec: DenoiseSpec, repeats: int, device: torch.device, dtype: torch.dtype) -> dict:
    denoiser = WanDenoiser(model, device, dtype)
    decoder = WanStreamingDecoder(model, device, torch.float32)
    conditionings = random_conditioning(denoiser.text_dim)
    mag_ratios = calibrate(denoiser, spec, random_conditioning(denoiser.text_dim)[0])
    args = (denoiser, decoder, spec)
    run(*args, CacheSpec(), conditionings, [0], mag_ratios)  # warm-up: allocator and kernels
    reference = run(*args, CacheSpec(), conditionings, [0], mag_ratios, repeats)
    rows = []
    for cache in caches():
        result = run(*args, cache, conditionings, [0], mag_ratios, repeats)
        passes_run, passes_skipped = result["passes"]
        skipped = passes_skipped / (passes_run + passes_skipped)
        saved = 1 - result["denoise_s"] / reference["denoise_s"]
        rows.append(
            {
                "method": cache.method,
                "threshold": cache.threshold,
                "passes_skipped_fraction": round(skipped, 4),
                "denoise_s": round(result["denoise_s"], 3),
                "time_saved_fraction": round(saved, 4),
                "saved_over_skipped": round(saved / skipped, 3) if skipped else None,
                "speedup": round(reference["denoise_s"] / result["denoise_s"], 3),
                "psnr_db_vs_uncached": round(psnr(result["frames"], reference["frames"]), 2),
            }
        )
    return {"uncached_denoise_s": round(reference["denoise_s"], 3), "runs": rows}


def demo_quality(cases: int, device: torch.device, dtype: torch.dtype) -> dict:
    model = DEMO_CHECKPOINT
    spec = spec_of(DEMO_REQUEST, DEMO_REQUEST["num_inference_steps"])
    chosen = evaluation_set(seeds=(0,))[:cases]
    conditionings, seeds = prompt_conditioning(model, chosen), [case.seed for case in chosen]
    denoiser = WanDenoiser(model, device, dtype)
    decoder = WanStreamingDecoder(model, device, torch.float32)
    # Calibrated on the prompt of a case that is not measured, with another seed.
    mag_ratios = calibrate(denoiser, spec, prompt_conditioning(model, evaluation_set(seeds=(0,))[-1:])[0])
    reference = run(denoiser, decoder, spec, CacheSpec(), conditionings, seeds, mag_ratios)
    rows = []
    for cache in caches():
        result = run(denoiser, decoder, spec, cache, conditionings, seeds, mag_ratios)
        passes_run, passes_skipped = result["passes"]
        rows.append(
            {
                "method": cache.method,
                "threshold": cache.threshold,
                "passes_skipped_fraction": round(passes_skipped / (passes_run + passes_skipped), 4),
                "quality_all": quality(result["videos"], chosen),
                "psnr_db_vs_uncached": round(psnr(result["frames"], reference["frames"]), 2),
            }
        )
    return {
        "request": {**DEMO_REQUEST, "videos": len(chosen)},
        "uncached_quality_all": quality(reference["videos"], chosen),
        "runs": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--model", help="existing wan-t2v checkpoint for the speed part (default: init-model)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps of the speed part")
    parser.add_argument("--repeats", type=int, default=1, help="denoising runs per configuration (median)")
    parser.add_argument("--cases", type=int, default=24, help="prompts of the demo model's evaluation set")
    parser.add_argument("--skip-quality", action="store_true", help="only the speed part")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="the DiT's compute dtype")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    request = DEFAULT_REQUESTS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else init_model("wan-t2v", args.preset, Path(tmp) / args.preset, seed=0)
        with torch.no_grad():
            report = {
                "benchmark": "step_cache",
                "speed": {
                    "preset": args.preset,
                    "request": {**request, "num_inference_steps": args.steps},
                    **speed(model, spec_of(request, args.steps), args.repeats, device, dtype),
                },
            }
            if not args.skip_quality:
                report["quality"] = demo_quality(args.cases, device, dtype)
    report.update(
        device=str(device),
        dtype=args.dtype,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        machine=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
