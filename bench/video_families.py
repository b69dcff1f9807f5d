"""The video families stage by stage on the small presets, and at real size against the memory guard, in one run.

  small      per family (its "small" preset, random weights): each stage in a fresh process builds the family's
             compute as the stage does (the registry's text encoder, the VAE's image encoder, `make_denoiser`,
             the decoder; float32 on the CPU with --threads threads), runs the preset's default request and
             reports its load and run seconds and the process's peak resident memory (VmHWM). The stages run in
             the cluster's order, the next reading what the last one made: the text encoder (the prompt and,
             with CFG, the negative prompt; the input image too where the family's text encoder embeds it), the
             VAE's Encode of the input image (families that take one: the first frame for image-to-video), the
             denoising loop, and the decode, streamed one latent frame at a time as the VAE stage decodes. A
             family that makes sound (LTX-2) denoises its audio latents in the same loop, and its VAE stage
             decodes them after the frames (the audio VAE and the vocoder).
             An image-to-video family gets a generated first frame of the default size; its output size is the
             one the family makes from the image (HunyuanVideo 1.5's crop bucket), as the orchestrator makes it.
  real_size  per real-size preset (`*-config`: the published configs with random bf16 weights), the memory
             guard's need of each stage in bf16 on this machine's CPU from the components built on the meta
             device, and its verdict against this machine's available memory. With --write PRESET (repeatable)
             the checkpoint is written in a fresh process and, per stage in a fresh process, the need is computed
             again from its files as the stage computes it, then the stage's weights are loaded as it loads them
             (bf16, --threads reads): seconds and peak resident memory beside the estimate; the checkpoint is
             removed after (bench/family_stages.py, shared with bench/image_families.py). One stage loads at a
             time: a real-size text encoder and DiT together do not fit a 24 GB machine. A stage the estimate
             refuses here is neither written nor loaded, its refusal reported instead (LTX-2's text encoder
             and DiT on 24 GB: they would also fill the disk); the stages that fit are written alone. With
             --write-refused each refused stage is then written alone as well, for the write's seconds and peak
             and the need from its files (nothing loaded), and removed.

A family is one entry of VIDEO_FAMILIES: its name in the registry and its real-size presets with the module
that builds them. Everything else (stages, image inputs, output size) comes from the family's declarations.

    python bench/video_families.py [--families hunyuanvideo-1.5 ltx-2 ...] [--estimate PRESET ...]
                                   [--write hunyuanvideo-1.5-480p-config ...] [--write-refused] [--threads 2]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import io
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

from bench.family_stages import estimate, in_fresh_process, measure_written, peak_rss  # noqa: E402

# family -> its real-size presets: preset -> the module whose `real_size_builders(preset)` gives its components.
VIDEO_FAMILIES: dict[str, dict[str, str]] = {
    "hunyuanvideo-1.5": {"hunyuanvideo-1.5-480p-config": "families.hunyuanvideo_15.real_size"},
    "hunyuanvideo-1.5-i2v": {"hunyuanvideo-1.5-480p-i2v-config": "families.hunyuanvideo_15.real_size"},
    "ltx-2": {"ltx-2-config": "families.ltx2.real_size", "ltx-2.3-config": "families.ltx2.real_size"},
}
REAL_SIZE = {
    preset: (family, module) for family, presets in VIDEO_FAMILIES.items() for preset, module in presets.items()
}
PROMPT = 'a red fox trots across fresh snow at dawn past a wooden sign that says "north", cinematic light'
NEGATIVE = "blurry, low quality"
# Files the stages of one request share in its work directory.
REQUEST, FIRST_FRAME = "request.json", "first_frame.png"
CONDITIONING, IMAGE_TENSORS, LATENTS = "conditioning.pt", "image_tensors.pt", "latents.pt"
AUDIO_LATENTS = "audio_latents.pt"


def stages_of(family_name: str) -> tuple[str, ...]:
    """The family's stages in the cluster's order: the VAE's Encode where the family's images go to the VAE."""
    from families.registry import FAMILIES

    images = FAMILIES[family_name].images
    return ("text-encoder", *(("vae-encode",) if "vae" in images.encoded_by else ()), "dit", "vae")


def first_frame_png(width: int, height: int) -> bytes:
    """A deterministic first frame: colour gradients with noise, as a PNG."""
    import numpy as np
    from PIL import Image

    rows, columns = np.mgrid[0:height, 0:width]
    gradient = np.stack([255 * columns / max(width - 1, 1), 255 * rows / max(height - 1, 1), (rows + columns) % 256])
    noise = np.random.default_rng(0).normal(0, 16, gradient.shape)
    pixels = np.clip(gradient + noise, 0, 255).astype(np.uint8).transpose(1, 2, 0)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def prepare_request(model: Path, work: Path) -> dict[str, Any]:
    """The preset's default request, written to `work` for the stages (with a generated frame of the default size,
    for a family that takes images); an image-to-video family's size is the one it makes from the frame."""
    from PIL import Image

    from services.checkpoint import read_checkpoint

    spec = read_checkpoint(model)
    family, defaults = spec.traits, spec.defaults
    request: dict[str, Any] = {
        "height": defaults.height,
        "width": defaults.width,
        "num_frames": defaults.num_frames,
        "num_inference_steps": defaults.num_inference_steps,
        "guidance_scale": defaults.guidance_scale,
        "fps": defaults.fps,
        "image_roles": [],
        "image_sizes": [],
    }
    if family.images.roles:
        data = first_frame_png(defaults.width, defaults.height)
        (work / FIRST_FRAME).write_bytes(data)
        image = Image.open(io.BytesIO(data))
        size_from = family.images.size_from
        if size_from is not None:
            request["width"], request["height"] = size_from.size(
                image.width, image.height, spec.height_multiple, spec.image_size_base
            )
        # The same frame for each role the family requires (its first role where it requires none).
        roles = list(family.images.required or family.images.roles[:1])
        request.update(
            image_roles=roles,
            image_sizes=[[image.width, image.height]] * len(roles),
            image_sha256=hashlib.sha256(data).hexdigest(),
        )
    (work / REQUEST).write_text(json.dumps(request))
    return request


def _small_stage(stage: str, model: str, work: str, threads: int) -> dict[str, Any]:
    """One stage of the request in `work`, as the stage builds and runs it; its output saved in `work`."""
    import torch
    from PIL import Image

    from dit_svc.denoise import make_denoiser
    from services.checkpoint import read_checkpoint
    from stagekit.decode import session_takes_frame_count
    from stagekit.denoise import DenoiseSpec, makes_audio
    from stagekit.images import DecodedImage

    torch.set_num_threads(threads)
    cpu, spec, directory = torch.device("cpu"), read_checkpoint(model), Path(work)
    family = spec.traits
    request = json.loads((directory / REQUEST).read_text())
    denoise_spec = DenoiseSpec(
        height=request["height"],
        width=request["width"],
        num_frames=request["num_frames"],
        num_inference_steps=request["num_inference_steps"],
        guidance_scale=request["guidance_scale"],
        seed=0,
        image_roles=tuple(request["image_roles"]),
        image_sizes=tuple((width, height) for width, height in request["image_sizes"]),
        cfg_threshold=family.cfg_threshold,
        fps=request["fps"],
    )
    images = [
        DecodedImage(role, Image.open(directory / FIRST_FRAME).convert("RGB"), request["image_sha256"])
        for role in request["image_roles"]
    ]
    outputs: dict[str, Any] = {}
    started = time.perf_counter()
    with torch.no_grad():
        if stage == "text-encoder":
            encoder = family.load("text_encoder")(model, "bench", cpu, torch.float32)
            loaded = time.perf_counter()
            texts = [PROMPT, NEGATIVE] if denoise_spec.do_classifier_free_guidance else [PROMPT]
            batched, _ = encoder.encode(texts, spec.max_sequence_length)
            # Named as the stage sends them: "<role>_<name>" for each text.
            roles = ("prompt", "negative_prompt")
            conditioning = {
                f"{role}_{name}": tensor[i : i + 1]
                for i, role in enumerate(roles[: len(texts)])
                for name, tensor in batched.items()
            }
            if images and "text-encoder" in family.images.encoded_by:
                pictures, digests = [image.image for image in images], [image.sha256 for image in images]
                conditioning[encoder.image_tensor_name], _ = encoder.encode_images(pictures, digests)
            torch.save(conditioning, directory / CONDITIONING)
        elif stage == "vae-encode":
            decoder = family.load("decoder")(model, cpu, torch.float32)
            image_encoder = family.load("image_encoder")(model)
            loaded = time.perf_counter()
            tensors = image_encoder(decoder, images, denoise_spec.height, denoise_spec.width, denoise_spec.num_frames)
            torch.save(tensors, directory / IMAGE_TENSORS)
            outputs["tensors"] = {name: list(tensor.shape) for name, tensor in tensors.items()}
        elif stage == "dit":
            denoiser = make_denoiser(model, cpu, torch.float32)
            loaded = time.perf_counter()
            conditioning = torch.load(directory / CONDITIONING)
            if (directory / IMAGE_TENSORS).exists():
                conditioning.update(torch.load(directory / IMAGE_TENSORS))
            if makes_audio(denoiser):
                # The video and the sound in one loop (LTX-2); the sound's latents go to the VAE stage too.
                latents, audio_latents = denoiser.denoise_av(
                    denoise_spec, conditioning, lambda step, total: None, lambda: False
                )
                torch.save(audio_latents, directory / AUDIO_LATENTS)
                outputs["audio_latents"] = list(audio_latents.shape)
            else:
                latents = denoiser.denoise(denoise_spec, conditioning, lambda step, total: None, lambda: False)
            torch.save(latents, directory / LATENTS)
            outputs["latents"] = list(latents.shape)
        else:
            decoder = family.load("decoder")(model, cpu, torch.float32)
            loaded = time.perf_counter()
            latents = torch.load(directory / LATENTS)
            count = latents.shape[2]
            # LTX-2's session decodes the whole video at the last latent frame, so it is told which that is.
            session = (
                decoder.session(num_latent_frames=count) if session_takes_frame_count(decoder) else decoder.session()
            )
            # One latent frame at a time, as the DiT streams them to the VAE stage.
            frames = torch.cat([session.decode_next(latents[:, :, t : t + 1]) for t in range(count)])
            expected = (denoise_spec.num_frames, denoise_spec.height, denoise_spec.width, 3)
            assert tuple(frames.shape) == expected, (tuple(frames.shape), expected)
            outputs["frames"] = list(frames.shape)
            if (directory / AUDIO_LATENTS).exists():
                # Then the sound, as the VAE stage decodes it after the frames: the audio VAE and the vocoder.
                waveform, rate = decoder.decode_audio(torch.load(directory / AUDIO_LATENTS))
                outputs["audio"] = {"shape": list(waveform.shape), "sample_rate": rate}
    finished = time.perf_counter()
    return {
        "load_s": round(loaded - started, 3),
        "run_s": round(finished - loaded, 3),
        "peak_rss_bytes": peak_rss(),
        **outputs,
    }


def measure_small(families: list[str], threads: int, root: Path) -> dict[str, Any]:
    from families.init_model import init_model

    results: dict[str, Any] = {}
    for name in families:
        model = init_model(name, "small", root / name)
        work = Path(tempfile.mkdtemp(dir=root))
        request = prepare_request(model, work)
        stages = {
            stage: in_fresh_process(_small_stage, stage, str(model), str(work), threads) for stage in stages_of(name)
        }
        results[name] = {
            "request": {
                "size": f"{request['width']}x{request['height']}",
                "frames": request["num_frames"],
                "steps": request["num_inference_steps"],
                "guidance_scale": request["guidance_scale"],
                "input_image": "x".join(map(str, request["image_sizes"][0])) if request["image_sizes"] else None,
            },
            "stages": stages,
        }
        print(
            f"small {name}: " + json.dumps({s: (v["run_s"], v["peak_rss_bytes"]) for s, v in stages.items()}),
            file=sys.stderr,
        )
    return results


def estimate_preset(preset: str) -> dict[str, Any]:
    _, module = REAL_SIZE[preset]
    return estimate(importlib.import_module(module).real_size_builders(preset))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=list(VIDEO_FAMILIES), help="small presets to run")
    parser.add_argument("--estimate", nargs="*", default=list(REAL_SIZE), help="real-size presets to estimate")
    parser.add_argument("--write", action="append", default=[], choices=list(REAL_SIZE), help="also write and load")
    parser.add_argument(
        "--write-refused",
        action="store_true",
        help="with --write, also write each stage the guard refuses here alone and compute its need from the files "
        "(nothing loaded; LTX-2's text encoder and DiT)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    import diffusers
    import torch
    import transformers

    report: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
        },
        "threads": args.threads,
        # Per section: its wall seconds and the machine's 1-minute load average before and after it (other
        # work on the machine shows there, and in the seconds).
        "sections": {},
    }

    def section(name: str, started: float, load_before: float) -> None:
        wall = round(time.perf_counter() - started, 1)
        report["sections"][name] = {"wall_s": wall, "load_average": [load_before, os.getloadavg()[0]]}

    with tempfile.TemporaryDirectory(prefix="bench-video-families-") as directory:
        root = Path(directory)
        started, load = time.perf_counter(), os.getloadavg()[0]
        report["small"] = measure_small(args.families, args.threads, root)
        if args.families:
            section("small", started, load)
        report["real_size"] = {preset: estimate_preset(preset) for preset in args.estimate}
        for preset in args.write:
            started, load = time.perf_counter(), os.getloadavg()[0]
            family, _ = REAL_SIZE[preset]
            estimated = report["real_size"].setdefault(preset, estimate_preset(preset))
            estimated["written"] = measure_written(
                family, preset, args.threads, root, estimated["stages"], args.write_refused
            )
            section(preset, started, load)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
