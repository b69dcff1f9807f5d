"""FLUX.1-dev at real size on one GPU: our DiT against diffusers' FluxPipeline, 1024x1024, 28 steps, in bf16.

The checkpoint is init-model's "flux.1-dev-config" preset (FLUX.1-dev's published configs with random bf16 weights,
about 34 GB), written to a temporary directory unless --model names one. Both sides get the same random T5
sequence [1, 512, 4096] and CLIP pooled vector [1, 768], the embedded guidance 3.5 and no true CFG (one
transformer pass per step, as FLUX.1-dev runs), and diffusers' "native" attention backend
(torch.nn.functional.scaled_dot_product_attention). Each side runs a 2-step request first (warm-up, and the
compilation with --compile), then the timed request:

- ours: the DiT stage's denoiser as the stage builds it (`make_denoiser`, with regional compilation when
  --compile) running `denoise`;
- diffusers: FluxPipeline (its transformer of the same checkpoint, its text encoders left out: embeddings in,
  latents out), with `transformer.compile_repeated_blocks(fullgraph=True)` when --compile.

The JSON has each side's seconds for the request, seconds per step, the peak allocated memory, the ratio ours /
diffusers and the published anchor (xDiT's FLUX.1-dev on one H100: 6.71 s, 4.30 s compiled).
`--dry-run` runs the same on the CPU with the tiny preset (64x64, 2 steps, float32).

    python bench/flux_gpu.py [--compile] [--model DIR] [--out FILE]
    python bench/flux_gpu.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# xDiT's published FLUX.1-dev 1024x1024, 28 steps, one H100 (its README's performance table).
ANCHORS = {"xdit_flux1_dev_1024_28_steps_h100_s": 6.71, "xdit_flux1_dev_1024_28_steps_h100_compiled_s": 4.30}


def _timed(run: Callable[[], Any], device: Any) -> tuple[float, int]:
    """Seconds of `run()` and the peak allocated memory during it (CUDA), or 0 on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return time.perf_counter() - started, peak


def time_ours(model: Path, size: int, steps: int, compile_blocks: bool, device: Any, dtype: Any) -> dict[str, Any]:
    """Our DiT's denoiser, built and run as the stage builds and runs it; freed on return."""
    from dit_svc.config import DenoiserBuild
    from dit_svc.denoise import make_denoiser
    from dit_svc.model_options import ModelOptions
    from stagekit.denoise import DenoiseSpec

    denoiser = make_denoiser(model, device, dtype, DenoiserBuild(options=ModelOptions(compile=compile_blocks)))
    denoiser.transformer.set_attention_backend("native")
    embeds, pooled = conditioning(denoiser.text_dim, denoiser.pooled_dim)

    def request(request_steps: int) -> Any:
        spec = DenoiseSpec(size, size, 1, request_steps, 1.0, 0, embedded_guidance_scale=3.5)
        named = {"prompt_embeds": embeds, "prompt_pooled_embeds": pooled}
        return denoiser.denoise(spec, named, lambda step, total: None, lambda: False)

    request(2)
    seconds, peak = _timed(lambda: request(steps), device)
    return {"seconds": round(seconds, 3), "seconds_per_step": round(seconds / steps, 4), "peak_bytes": peak}


def time_diffusers(model: Path, size: int, steps: int, compile_blocks: bool, device: Any, dtype: Any) -> dict[str, Any]:
    """FluxPipeline on the same checkpoint, embeddings in and latents out; freed on return."""
    import torch
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(model, torch_dtype=dtype, text_encoder=None, text_encoder_2=None).to(device)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.transformer.set_attention_backend("native")
    if compile_blocks:
        pipeline.transformer.compile_repeated_blocks(fullgraph=True)
    config = pipeline.transformer.config
    embeds, pooled = conditioning(config.joint_attention_dim, config.pooled_projection_dim)

    def request(request_steps: int) -> Any:
        return pipeline(
            prompt_embeds=embeds.to(device, dtype),
            pooled_prompt_embeds=pooled.to(device, dtype),
            height=size,
            width=size,
            num_inference_steps=request_steps,
            guidance_scale=3.5,
            generator=torch.Generator("cpu").manual_seed(0),
            output_type="latent",
        ).images

    request(2)
    seconds, peak = _timed(lambda: request(steps), device)
    return {"seconds": round(seconds, 3), "seconds_per_step": round(seconds / steps, 4), "peak_bytes": peak}


def conditioning(text_dim: int, pooled_dim: int) -> tuple[Any, Any]:
    """The same random T5 sequence [1, 512, text_dim] and CLIP pooled vector [1, pooled_dim] for both sides."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(1, 512, text_dim, generator=generator), torch.randn(1, pooled_dim, generator=generator)


def run(model: Path, size: int, steps: int, compile_blocks: bool, device_name: str, dtype_name: str) -> dict[str, Any]:
    import gc

    import torch

    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    ours = time_ours(model, size, steps, compile_blocks, device, dtype)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    theirs = time_diffusers(model, size, steps, compile_blocks, device, dtype)
    return {
        "ours": ours,
        "diffusers": theirs,
        "ratio_ours_over_diffusers": round(ours["seconds"] / theirs["seconds"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a flux.1-dev-config checkpoint (written when absent)")
    parser.add_argument("--compile", action="store_true", help="regional compilation on both sides")
    parser.add_argument("--dry-run", action="store_true", help="the tiny preset on the CPU, 64x64, 2 steps")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import diffusers
    import torch

    from families.init_model import init_model

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench/flux_gpu.py needs a CUDA GPU; --dry-run runs it on the CPU with the tiny preset")
    preset, size, steps = ("tiny", 64, 2) if args.dry_run else ("flux.1-dev-config", 1024, 28)
    device, dtype = ("cpu", "float32") if args.dry_run else ("cuda", "bfloat16")
    with tempfile.TemporaryDirectory(prefix="bench-flux-") as directory:
        model = args.model or Path(directory) / preset
        if not (model / "model_index.json").exists():
            init_model("flux", preset, model)
        results = run(model, size, steps, args.compile, device, dtype)
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__},
        "request": {"size": f"{size}x{size}", "steps": steps, "embedded_guidance_scale": 3.5, "compile": args.compile},
        "anchors": ANCHORS,
        **results,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
