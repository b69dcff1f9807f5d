"""The image families stage by stage on the small presets, and at real size against the memory guard, in one run.

  small      per family (its "small" preset, random weights): each stage in a fresh process builds the family's
             compute as the stage does (the registry's text encoder, `make_denoiser`, the decoder; float32 on
             the CPU with --threads threads), runs the preset's default request (the prompt and, with CFG, the
             negative prompt; the denoising loop; the decode), and reports its load and run seconds and the
             process's peak resident memory (VmHWM). The next stage reads what the last one made.
  real_size  per real-size preset (`*-config`: a published checkpoint's configs with random bf16 weights), the
             memory guard's need of each stage in bf16 on this machine's CPU, computed from the components built
             on the meta device by the rule the stages load by (bf16, the classes' fp32 modules in fp32, plus the
             guard's runtime reserve), and its verdict against this machine's available memory. With
             --write PRESET (repeatable) the checkpoint is written (in a fresh process) and, per stage in a fresh
             process, the need is computed again from its files as the stage computes it
             (services/memory_budget.py stage_need), then the stage's components are loaded as it loads them
             (stagekit load_pretrained, bf16, --threads reads): seconds and peak resident memory beside the
             estimate. bench/family_stages.py holds these real-size measurements (bench/video_families.py's too).

    python bench/image_families.py [--families flux z-image ...] [--write z-image-turbo-config ...] [--threads 2]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.family_stages import STAGES, in_fresh_process, measure_written, peak_rss  # noqa: E402
from bench.family_stages import estimate as estimate_stages  # noqa: E402

SMALL_FAMILIES = ("flux", "z-image", "flux2-klein", "qwen-image")
# Real-size presets: (family, the module whose `real_size_builders(preset)` gives its components).
REAL_SIZE = {
    "flux.1-dev-config": ("flux", "families.flux.real_size"),
    "flux.1-schnell-config": ("flux", "families.flux.real_size"),
    "z-image-turbo-config": ("z-image", "families.z_image.real_size"),
    "flux2-klein-4b-config": ("flux2-klein", "families.flux2_klein.real_size"),
}
PROMPT = "a red fox running through fresh snow at dawn, cinematic light"
NEGATIVE = "blurry, low quality"


def _small_stage(stage: str, model: str, work: str, threads: int) -> dict[str, Any]:
    """One stage of the preset's default request, as the stage builds and runs it; its output saved in `work`."""
    import torch

    from dit_svc.denoise import make_denoiser
    from services.checkpoint import read_checkpoint
    from stagekit.denoise import DenoiseSpec

    torch.set_num_threads(threads)
    cpu, spec = torch.device("cpu"), read_checkpoint(model)
    family, defaults = spec.traits, spec.defaults
    request = DenoiseSpec(
        height=defaults.height,
        width=defaults.width,
        num_frames=defaults.num_frames,
        num_inference_steps=defaults.num_inference_steps,
        guidance_scale=defaults.guidance_scale,
        seed=0,
        embedded_guidance_scale=defaults.embedded_guidance_scale,
    )
    conditioning_file, latents_file = Path(work) / "conditioning.pt", Path(work) / "latents.pt"
    started = time.perf_counter()
    with torch.no_grad():
        if stage == "text-encoder":
            encoder = family.load("text_encoder")(model, "bench", cpu, torch.float32)
            loaded = time.perf_counter()
            texts = [PROMPT, NEGATIVE] if request.do_classifier_free_guidance else [PROMPT]
            batched, _ = encoder.encode(texts, spec.max_sequence_length)
            # Named as the stage sends them: "<role>_<name>" for each text.
            roles = ("prompt", "negative_prompt")
            conditioning = {
                f"{role}_{name}": tensor[i : i + 1]
                for i, role in enumerate(roles[: len(texts)])
                for name, tensor in batched.items()
            }
            torch.save(conditioning, conditioning_file)
        elif stage == "dit":
            denoiser = make_denoiser(model, cpu, torch.float32)
            loaded = time.perf_counter()
            conditioning = torch.load(conditioning_file)
            latents = denoiser.denoise(request, conditioning, lambda step, total: None, lambda: False)
            torch.save(latents, latents_file)
        else:
            decoder = family.load("decoder")(model, cpu, torch.float32)
            loaded = time.perf_counter()
            frames = decoder.session().decode_next(torch.load(latents_file))
            assert frames.shape == (1, request.height, request.width, 3), frames.shape
    finished = time.perf_counter()
    return {
        "load_s": round(loaded - started, 3),
        "run_s": round(finished - loaded, 3),
        "peak_rss_bytes": peak_rss(),
    }


def measure_small(families: list[str], threads: int, root: Path) -> dict[str, Any]:
    from families.init_model import init_model
    from services.checkpoint import read_checkpoint

    results: dict[str, Any] = {}
    for name in families:
        model = init_model(name, "small", root / name)
        defaults = read_checkpoint(model).defaults
        work = tempfile.mkdtemp(dir=root)
        stages = {stage: in_fresh_process(_small_stage, stage, str(model), work, threads) for stage in STAGES}
        results[name] = {
            "request": {
                "size": f"{defaults.width}x{defaults.height}",
                "steps": defaults.num_inference_steps,
                "guidance_scale": defaults.guidance_scale,
                "embedded_guidance_scale": defaults.embedded_guidance_scale,
            },
            "stages": stages,
        }
        print(
            f"small {name}: " + json.dumps({s: (v["run_s"], v["peak_rss_bytes"]) for s, v in stages.items()}),
            file=sys.stderr,
        )
    return results


def estimate(preset: str) -> dict[str, Any]:
    """The guard's need per stage of a real-size preset, from its components on the meta device, and the verdict."""
    _, module = REAL_SIZE[preset]
    return estimate_stages(importlib.import_module(module).real_size_builders(preset))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=list(SMALL_FAMILIES), help="small presets to run")
    parser.add_argument("--estimate", nargs="*", default=list(REAL_SIZE), help="real-size presets to estimate")
    parser.add_argument("--write", action="append", default=[], choices=list(REAL_SIZE), help="also write and load")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    import diffusers
    import torch

    report: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__},
        "threads": args.threads,
    }
    with tempfile.TemporaryDirectory(prefix="bench-image-families-") as directory:
        root = Path(directory)
        report["small"] = measure_small(args.families, args.threads, root)
        report["real_size"] = {preset: estimate(preset) for preset in args.estimate}
        for preset in args.write:
            family, _ = REAL_SIZE[preset]
            report["real_size"].setdefault(preset, estimate(preset))["written"] = measure_written(
                family, preset, args.threads, root
            )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
