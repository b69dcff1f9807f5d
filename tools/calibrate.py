"""`stagediff calibrate-cache`: MagCache's magnitude ratios for a checkpoint.

MagCache decides which steps to skip from the ratio of the transformer's residual norm between consecutive
steps, which is a property of the model and its schedule rather than of a prompt (the MagCache paper's
observation). diffusers' MagCacheConfig(calibrate=True) measures it; this command runs one request that
way, in process, with the stage's own text encoder and denoiser, and writes the ratios of each expert and
guidance branch to `mag_ratios.json` in the checkpoint, where the DiT looks for them
(dit_svc/cache_offer.py). The DiT uses the prompt branch's ratios, resampled to each request's step count
as diffusers does, and offers `mag` once they are there.

    stagediff calibrate-cache --model DIR [--steps N] [--prompt P] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

import torch

from dit_svc.cache_offer import MAG_RATIOS_FILE
from dit_svc.denoise import denoise_request, make_denoiser
from services.checkpoint import CheckpointError, read_checkpoint
from services.stage import resolve_device, resolve_dtype
from stagekit.denoise import CacheSpec, DenoiseSpec
from text_encoder_svc.service import TEXT_ROLES

logger = logging.getLogger(__name__)
DEFAULT_PROMPT = "a red circle moves from left to right over a dark background"


def calibrate(
    model_dir: Path,
    spec: DenoiseSpec,
    prompt: str,
    negative_prompt: str,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, dict[str, list[float]]]:
    """{expert: {branch: one ratio per step the expert ran}} of one request run with MagCache calibrating."""
    checkpoint = read_checkpoint(model_dir)
    family = checkpoint.traits
    encoder = family.load("text_encoder")(checkpoint.path, checkpoint.model_id, device, dtype)
    texts = [prompt, negative_prompt] if spec.do_classifier_free_guidance else [prompt]
    with torch.no_grad():
        batched, _ = encoder.encode(texts, checkpoint.max_sequence_length)
    # Named as the text encoder stage sends them to the DiT ("prompt_embeds", "negative_prompt_embeds_mask").
    conditioning = {
        f"{role}_{name}": tensor[index : index + 1]
        for index, role in enumerate(TEXT_ROLES[: len(texts)])
        for name, tensor in batched.items()
    }
    denoiser = make_denoiser(checkpoint.path, device, dtype)
    calibration: dict[str, dict[str, list[float]]] = {}
    # diffusers prints the ratios it measured; what this command prints is the file it wrote.
    with contextlib.redirect_stdout(sys.stderr):
        denoise_request(
            denoiser,
            spec,
            conditioning,
            on_step=lambda step, total: None,
            cancelled=lambda: False,
            calibration=calibration,
        )
    return calibration


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stagediff calibrate-cache", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="diffusers checkpoint directory")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--negative-prompt", default="")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the model's default request)")
    parser.add_argument("--height", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--frames", type=int)
    parser.add_argument("--guidance", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", help=f"where to write the ratios (default: {MAG_RATIOS_FILE} in the checkpoint)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        checkpoint = read_checkpoint(args.model)
    except CheckpointError as error:
        print(f"stagediff calibrate-cache: {error}", file=sys.stderr)
        return 2
    family = checkpoint.traits
    if not family.support("mag_cache").supported:
        print(
            f"stagediff calibrate-cache: the {family.name} family does not offer MagCache: "
            f"{family.support('mag_cache').reason}",
            file=sys.stderr,
        )
        return 2
    defaults = checkpoint.defaults
    spec = DenoiseSpec(
        height=args.height or defaults.height,
        width=args.width or defaults.width,
        num_frames=args.frames or defaults.num_frames,
        num_inference_steps=args.steps or defaults.num_inference_steps,
        guidance_scale=defaults.guidance_scale if args.guidance is None else args.guidance,
        seed=args.seed,
        # The threshold is unused while calibrating: every pass runs.
        cache=CacheSpec("mag", 1.0),
    )
    device = resolve_device(args.device)
    started = time.perf_counter()
    ratios = calibrate(
        checkpoint.path, spec, args.prompt, args.negative_prompt, device, resolve_dtype(args.dtype, device)
    )
    out = Path(args.out) if args.out else checkpoint.path / MAG_RATIOS_FILE
    document = {
        "num_inference_steps": spec.num_inference_steps,
        "request": {"height": spec.height, "width": spec.width, "num_frames": spec.num_frames, "prompt": args.prompt},
        "ratios": ratios,
    }
    out.write_text(json.dumps(document, indent=1) + "\n")
    logger.info("calibrated %d steps in %.1f s", spec.num_inference_steps, time.perf_counter() - started)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
