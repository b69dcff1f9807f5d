"""HunyuanVideo 1.5 text-to-video at 480p on one GPU: our stages against diffusers' HunyuanVideo15Pipeline, in bf16.

The checkpoint is init-model's "hunyuanvideo-1.5-480p-config" preset (HunyuanVideo-1.5-Diffusers-480p_t2v's published
configs with random bf16 weights: the 8.3B transformer, Qwen2.5-VL-7B's language model, the glyph ByT5, the VAE;
about 33 GB), written to a temporary directory unless --model names one. The request: 480x848, 33 frames (9 latent
frames), 8 steps, CFG at the guider's 6.0 (two transformer passes a step), seed 0, a prompt with quoted text (so
ByT5 runs) and a negative prompt. Everything runs in bf16 on one CUDA GPU with diffusers' "native" attention backend
(torch.nn.functional.scaled_dot_product_attention) on both sides. Per stage, each side's seconds for the request
after one warm-up call, and the peak memory allocated during it beside what was allocated before it:

- text_encoder: ours, the text-encoder stage's encoder (the registry's, Qwen2.5-VL and ByT5) encoding the prompt and
  the negative prompt; theirs, HunyuanVideo15Pipeline.encode_prompt of each, as its __call__ runs it. The warm-up
  encodes other texts, so that the timed call misses our encoder's cache.
- dit: ours, the DiT stage's denoiser (`make_denoiser`) on our encoder's tensors (each text at its own length);
  theirs, the pipeline's call on its own encode_prompt outputs (padded to 1000 and 256 tokens, beside a 729-token
  zero image), output_type="latent". The warm-up is a 1-step request. Both draw the seed's noise alike, so the
  latents agree up to bf16 rounding: their largest difference is reported.
- vae: ours, the VAE stage's streaming decoder, one latent frame at a time as the DiT sends them; theirs, the
  pipeline's decode of the whole latent video (vae.decode after the scaling factor, then its postprocessing). The
  warm-up decodes the first two latent frames.

The sides run one after the other and each frees its models before the next loads: ours holds one stage's model
at a time, as the cluster's stage processes hold them; theirs holds the whole pipeline on the GPU, as
`pipeline.to("cuda")` does (compare the excess over what was allocated before, not the peaks). The report has both
sides' stages, their sums and the ratios ours / theirs, the two outputs' differences, the request's token counts
and the section wall times.

Budget (an estimate: no GPU has run it yet): on one H100 machine, about 3 minutes to write the checkpoint (163 s on
the 2-core CPU machine of BENCHMARKS.md), then on each side about 35 GB read from the page cache, a 1-step warm-up
and the 8 steps (two transformer passes each at 14,310 video tokens) and two decodes: about 6 to 8 minutes in all,
under bench-gpu's 10-minute slot. `--steps` trims the DiT's share.

`--dry-run` runs the same on the CPU with the tiny preset (48x80, 9 frames, 2 steps, float32) in seconds;
tests/integration/test_bench_hunyuanvideo_gpu.py runs it. Without CUDA and without --dry-run the script stops with
an error.

    python bench/hunyuanvideo_gpu.py [--model DIR] [--steps 8] [--out FILE]
    python bench/hunyuanvideo_gpu.py --dry-run
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FAMILY = "hunyuanvideo-1.5"
PROMPT = 'A red fox trots across a snowy field at dawn past a wooden sign that says "north", cinematic light'
NEGATIVE = "blurry, low quality, distorted"
WARM_UP_TEXTS = ["a grey cat on a windowsill", "overexposed"]
STAGES = ("text_encoder", "dit", "vae")


@dataclass(frozen=True)
class Request:
    preset: str
    height: int
    width: int
    num_frames: int
    steps: int
    device: str
    dtype: str


REAL = Request("hunyuanvideo-1.5-480p-config", 480, 848, 33, 8, "cuda", "bfloat16")
DRY_RUN = Request("tiny", 48, 80, 9, 2, "cpu", "float32")


def timed(run: Callable[[], Any], device: Any) -> tuple[Any, dict[str, Any]]:
    """`run()`'s result and its seconds; on CUDA also the peak memory allocated during it and what was allocated
    before it (None on the CPU, where this process's allocations are not told apart)."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else None
    started = time.perf_counter()
    result = run()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return result, {"seconds": round(seconds, 3), "peak_bytes": peak, "before_bytes": before}


def free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def our_text_encoder(model: Path, device: Any, dtype: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text-encoder stage's encoder on the prompt and the negative prompt: its timing and the tensors it sends,
    named as the DiT stage receives them."""
    from services.checkpoint import read_checkpoint

    spec = read_checkpoint(model)
    encoder = spec.traits.load("text_encoder")(model, "bench", device, dtype)
    encoder.encode(WARM_UP_TEXTS, spec.max_sequence_length)
    (batched, _), timing = timed(lambda: encoder.encode([PROMPT, NEGATIVE], spec.max_sequence_length), device)
    timing["tokens"] = {name: int(batched[f"{name}_mask"][0].sum()) for name in ("embeds", "glyph_embeds")}
    conditioning = {
        f"{role}_{name}": tensor[i : i + 1]
        for i, role in enumerate(("prompt", "negative_prompt"))
        for name, tensor in batched.items()
    }
    return timing, conditioning


def our_dit(
    model: Path, request: Request, conditioning: dict[str, Any], device: Any, dtype: Any
) -> tuple[dict[str, Any], Any]:
    """The DiT stage's denoiser on `conditioning` at the checkpoint's guidance scale (the pipeline's guider's):
    its timing and the latents."""
    from dit_svc.denoise import make_denoiser
    from services.checkpoint import read_checkpoint
    from stagekit.denoise import DenoiseSpec

    guidance = read_checkpoint(model).defaults.guidance_scale
    denoiser = make_denoiser(model, device, dtype)
    denoiser.transformer.set_attention_backend("native")

    def denoise(steps: int) -> Any:
        denoise_spec = DenoiseSpec(request.height, request.width, request.num_frames, steps, guidance, seed=0)
        return denoiser.denoise(denoise_spec, conditioning, lambda step, total: None, lambda: False)

    denoise(1)
    latents, timing = timed(lambda: denoise(request.steps), device)
    return timing, latents


def our_vae(model: Path, latents: Any, device: Any, dtype: Any) -> tuple[dict[str, Any], Any]:
    """The VAE stage's streaming decoder, one latent frame at a time: its timing and the frames, uint8
    [F, H, W, 3]."""
    import torch

    from services.checkpoint import read_checkpoint

    decoder = read_checkpoint(model).traits.load("decoder")(model, device, dtype)

    def decode(frames: int) -> Any:
        session = decoder.session()
        return torch.cat([session.decode_next(latents[:, :, t : t + 1]) for t in range(frames)])

    decode(2)
    frames, timing = timed(lambda: decode(latents.shape[2]), device)
    return timing, frames


def ours(model: Path, request: Request, device: Any, dtype: Any) -> tuple[dict[str, Any], Any, Any]:
    """Our three stages, each built as its stage builds it and freed before the next: timings, latents, frames."""
    import torch

    results: dict[str, Any] = {}
    with torch.no_grad():
        results["text_encoder"], conditioning = our_text_encoder(model, device, dtype)
        free(device)
        results["dit"], latents = our_dit(model, request, conditioning, device, dtype)
        free(device)
        results["vae"], frames = our_vae(model, latents, device, dtype)
        free(device)
    return results, latents.float().cpu(), frames.cpu()


def their_stages(pipeline: Any, request: Request, device: Any) -> tuple[dict[str, Any], Any, Any]:
    """HunyuanVideo15Pipeline's three parts as its __call__ runs them: timings, latents, frames (float in [0, 1],
    [F, H, W, 3])."""
    import torch

    results: dict[str, Any] = {}

    def encode(texts: list[str]) -> list[Any]:
        return [pipeline.encode_prompt(text, device, pipeline.transformer.dtype) for text in texts]

    encode(WARM_UP_TEXTS)
    (positive, negative), results["text_encoder"] = timed(lambda: encode([PROMPT, NEGATIVE]), device)
    results["text_encoder"]["tokens"] = {
        "embeds": int(positive[1][0].sum()),
        "glyph_embeds": int(positive[3][0].sum()),
        "padded_to": [int(positive[0].shape[1]), int(positive[2].shape[1])],
    }
    names = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
    embeddings = dict(zip(names, positive, strict=True))
    embeddings.update({f"negative_{name}": tensor for name, tensor in zip(names, negative, strict=True)})

    def denoise(steps: int) -> Any:
        return pipeline(
            **embeddings,
            height=request.height,
            width=request.width,
            num_frames=request.num_frames,
            num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(0),
            output_type="latent",
        ).frames

    denoise(1)
    latents, results["dit"] = timed(lambda: denoise(request.steps), device)

    def decode(frames: int) -> Any:
        scaled = latents[:, :, :frames].to(pipeline.vae.dtype) / pipeline.vae.config.scaling_factor
        video = pipeline.vae.decode(scaled, return_dict=False)[0]
        return pipeline.video_processor.postprocess_video(video, output_type="np")

    decode(2)
    frames, results["vae"] = timed(lambda: decode(latents.shape[2]), device)
    return results, latents.float().cpu(), frames[0]


def theirs(model: Path, request: Request, device: Any, dtype: Any) -> tuple[dict[str, Any], Any, Any]:
    """HunyuanVideo15Pipeline on the same checkpoint, the whole pipeline on the device; freed on return."""
    import torch
    from diffusers import HunyuanVideo15Pipeline

    pipeline = HunyuanVideo15Pipeline.from_pretrained(model, torch_dtype=dtype).to(device)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.transformer.set_attention_backend("native")
    with torch.no_grad():
        return their_stages(pipeline, request, device)


def run(model: Path, request: Request) -> dict[str, Any]:
    """Both sides on `model` for `request`, ours first; their timings, ratios and the outputs' differences."""
    import numpy as np
    import torch

    from services.checkpoint import read_checkpoint

    device, dtype = torch.device(request.device), getattr(torch, request.dtype)
    walls: dict[str, float] = {}
    started = time.perf_counter()
    our_results, our_latents, our_frames = ours(model, request, device, dtype)
    walls["ours"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    their_results, their_latents, their_frames = theirs(model, request, device, dtype)
    free(device)
    walls["diffusers"] = round(time.perf_counter() - started, 1)
    for side in (our_results, their_results):
        side["total_s"] = round(sum(side[stage]["seconds"] for stage in STAGES), 3)
    ratios = {stage: round(our_results[stage]["seconds"] / their_results[stage]["seconds"], 3) for stage in STAGES}
    ratios["total"] = round(our_results["total_s"] / their_results["total_s"], 3)
    our_levels = our_frames.numpy().astype(np.float64)
    return {
        "guidance_scale": read_checkpoint(model).defaults.guidance_scale,
        "ours": our_results,
        "diffusers": their_results,
        "ratio_ours_over_diffusers": ratios,
        "latents_shape": list(our_latents.shape),
        "latents_max_abs_difference": float((our_latents - their_latents).abs().max()),
        "frames_shape": list(our_frames.shape),
        "frames_mean_abs_difference_levels": float(np.abs(our_levels - their_frames * 255).mean()),
        "section_wall_s": walls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a hunyuanvideo-1.5-480p-config checkpoint (written when absent)")
    parser.add_argument("--steps", type=int, default=REAL.steps, help="denoising steps of the timed request")
    parser.add_argument("--dry-run", action="store_true", help="the tiny preset on the CPU, 48x80, 9 frames, 2 steps")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import diffusers
    import torch
    import transformers

    from families.init_model import init_model

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(
            "bench/hunyuanvideo_gpu.py needs a CUDA GPU; --dry-run runs it on the CPU with the tiny preset"
        )
    request = DRY_RUN if args.dry_run else Request(**{**REAL.__dict__, "steps": args.steps})
    with tempfile.TemporaryDirectory(prefix="bench-hunyuanvideo-") as directory:
        model = args.model or Path(directory) / request.preset
        write_s = None
        if not (model / "model_index.json").exists():
            started = time.perf_counter()
            init_model(FAMILY, request.preset, model)
            write_s = round(time.perf_counter() - started, 1)
        results = run(model, request)
    report = {
        "benchmark": "hunyuanvideo_gpu",
        "mode": "dry-run" if args.dry_run else "gpu",
        "device": torch.cuda.get_device_name() if request.device == "cuda" else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
        },
        "request": {**request.__dict__, "attention_backend": "native"},
        "checkpoint_write_s": write_s,
        **results,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
