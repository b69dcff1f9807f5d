"""Frames from an fp8 / int8 weight-only quantized DiT, and from GGUF files of each type, against the
unquantized DiT, in one run.

Every configuration denoises the same seed and the same text embeddings for a few steps with
WanDenoiser in the compute dtype, then WanStreamingDecoder decodes the latents in float32; the
report gives the PSNR of each quantized run's uint8 frames against the unquantized run's, and
the DiT's parameter bytes against the bf16 model (loaded as the stage loads it: bf16 with the
model's float32-kept modules). Each GGUF type is the checkpoint's transformer written by `init-model --gguf`
(families/gguf.py) and loaded as the stage loads it (stagekit/gguf.py). Prints JSON.

With a random-weight preset (tiny, small) the embeddings are random and seeded. With
`--preset demo` (the trained shape-world model, shapeworld/checkpoint) they are the real
embeddings of `--cases` prompts of the quality check's evaluation set, at the model's default
request, and each configuration also gets the quality score of its videos
(shapeworld/score.py: the fraction showing the shape, colour, motion and background asked for),
so that a quantization error is measured where it changes what the video shows.

    python bench/quantization.py [--preset small] [--steps 4] [--dtype bf16]
    python bench/quantization.py --preset demo [--cases 24]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dit_svc.model_options import ModelOptions
from dit_svc.quantization import METHODS, parameter_bytes, quantize_transformer, torchao_available
from families.gguf import WRITABLE_TYPES, convert_checkpoint
from families.init_model import init_model
from families.registry import FAMILIES
from families.wan.decode import WanStreamingDecoder
from families.wan.denoise import WanDenoiser
from families.wan.encode import WanPromptEncoder
from families.wan.presets import DEFAULT_REQUESTS
from shapeworld.demo_model import CHECKPOINT as DEMO_CHECKPOINT
from shapeworld.demo_model import DEFAULT_REQUEST as DEMO_REQUEST
from shapeworld.demo_model import SEQUENCE_LENGTH
from shapeworld.evaluation import Case, evaluation_set
from shapeworld.score import read_video, score
from stagekit.denoise import DenoiseSpec
from stagekit.gguf import gguf_file, gguf_files

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CPU = torch.device("cpu")


def psnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    mse = (actual.double() - expected.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def random_conditioning(text_dim: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "prompt_embeds": torch.randn(1, 32, text_dim, generator=generator),
            "negative_prompt_embeds": torch.randn(1, 32, text_dim, generator=generator),
        }
    ]


def prompt_conditioning(model: Path, cases: list[Case]) -> list[dict[str, torch.Tensor]]:
    """Each case's prompt and the empty negative prompt, embedded as the text-encoder stage embeds them."""
    encoder = WanPromptEncoder(model, "bench", CPU, torch.float32)
    with torch.no_grad():
        negative = encoder.embed_many([""], SEQUENCE_LENGTH)
        prompts = encoder.embed_many([case.prompt for case in cases], SEQUENCE_LENGTH)
    return [{"prompt_embeds": p[None], "negative_prompt_embeds": negative} for p in prompts]


def generate(
    model: Path,
    spec: DenoiseSpec,
    dtype: torch.dtype,
    method: str | None,
    backend: str,
    conditionings: list[dict[str, torch.Tensor]],
    seeds: list[int],
) -> dict:
    """Frames [N x F, H, W, 3] of every conditioning (with its seed), the denoising seconds and the report.

    method: None (the model as it is: a GGUF checkpoint is loaded from its file), "fp8" or "int8"."""
    options = ModelOptions(quantization="gguf") if gguf_files(model / "transformer") else None
    denoiser = WanDenoiser(model, CPU, dtype, options=options)
    report = quantize_transformer(denoiser.transformer, method, [], backend=backend) if method else None
    decoder = WanStreamingDecoder(model, CPU, torch.float32)
    videos, seconds = [], 0.0
    for conditioning, seed in zip(conditionings, seeds, strict=True):
        started = time.perf_counter()
        latents = denoiser.denoise(
            replace(spec, seed=seed), conditioning, on_step=lambda i, n: None, cancelled=lambda: False
        )
        seconds += time.perf_counter() - started
        session = decoder.session()
        videos.append(torch.cat([session.decode_next(latents[:, :, t : t + 1]) for t in range(latents.shape[2])]))
    return {"videos": videos, "frames": torch.cat(videos), "denoise_s": seconds, "report": report}


def quality(videos: list[torch.Tensor], cases: list[Case]) -> float:
    """Fraction of the videos that show every attribute their prompt asks for."""
    results = [score(read_video(video.numpy()), case.concept) for video, case in zip(videos, cases, strict=True)]
    return round(sum(all(r.values()) for r in results) / len(results), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=[*sorted(DEFAULT_REQUESTS), "demo"])
    parser.add_argument("--model", help="existing checkpoint (default: make one with init-model)")
    parser.add_argument("--steps", type=int, help="denoising steps (default: 4, or the demo model's own)")
    parser.add_argument("--cases", type=int, default=24, help="--preset demo: prompts of the evaluation set to run")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--backends", default="native,torchao" if torchao_available() else "native")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--gguf-types",
        default=",".join(WRITABLE_TYPES),
        help=f"GGUF types to write and run, comma-separated (default: {','.join(WRITABLE_TYPES)}; '' for none)",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="fp8/int8 methods to run ('' for none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    demo = args.preset == "demo"
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model = Path(args.model)
        elif demo:
            model = DEMO_CHECKPOINT
        else:
            model = init_model("wan-t2v", args.preset, Path(tmp) / args.preset, seed=0)
        request = DEMO_REQUEST if demo else DEFAULT_REQUESTS[args.preset]
        steps = args.steps or (request["num_inference_steps"] if demo else 4)
        spec = DenoiseSpec(
            height=request["height"],
            width=request["width"],
            num_frames=request["num_frames"],
            num_inference_steps=steps,
            guidance_scale=request["guidance_scale"],
            seed=0,
        )
        dtype = DTYPES[args.dtype]
        bf16_bytes = parameter_bytes(WanDenoiser(model, CPU, torch.bfloat16).transformer)
        if demo:
            cases = evaluation_set(seeds=(0,))[: args.cases]
            conditionings, seeds = prompt_conditioning(model, cases), [case.seed for case in cases]
        else:
            cases, conditionings, seeds = [], random_conditioning(WanDenoiser(model, CPU, dtype).text_dim), [0]
        reference = generate(model, spec, dtype, None, "native", conditionings, seeds)
        if demo:
            reference["quality_all"] = quality(reference["videos"], cases)
            fp32 = generate(model, spec, torch.float32, None, "native", conditionings, seeds)
            reference["fp32_psnr_db"] = round(psnr(fp32["frames"], reference["frames"]), 2)
            reference["fp32_quality_all"] = quality(fp32["videos"], cases)
        runs = []
        for backend in args.backends.split(","):
            for method in [m for m in args.methods.split(",") if m]:
                run = generate(model, spec, dtype, method, backend, conditionings, seeds)
                # Bytes as deployed: the bf16 model quantized (the scales follow the layers' dtype).
                deployed = WanDenoiser(model, CPU, torch.bfloat16).transformer
                quantized_bytes = quantize_transformer(deployed, method, [], backend=backend).bytes_after
                runs.append(
                    {
                        "method": method,
                        "backend": backend,
                        "psnr_db": round(psnr(run["frames"], reference["frames"]), 2),
                        "max_abs_diff_uint8": int((run["frames"].int() - reference["frames"].int()).abs().max()),
                        "dit_parameter_bytes": quantized_bytes,
                        "bytes_ratio_vs_bf16": round(quantized_bytes / bf16_bytes, 4),
                        "layers_quantized": len(run["report"].quantized),
                        "denoise_s": round(run["denoise_s"], 2),
                        **({"quality_all": quality(run["videos"], cases)} if demo else {}),
                    }
                )
        for quant_type in [t for t in args.gguf_types.split(",") if t]:
            # The checkpoint with its transformer as a GGUF file, loaded as the stage loads it (stagekit/gguf.py).
            gguf_model = Path(tmp) / quant_type
            shutil.copytree(model, gguf_model)
            convert_checkpoint(gguf_model, FAMILIES["wan-t2v"], quant_type)
            run = generate(gguf_model, spec, dtype, None, "native", conditionings, seeds)
            deployed = WanDenoiser(gguf_model, CPU, torch.bfloat16, options=ModelOptions(quantization="gguf"))
            gguf_bytes = parameter_bytes(deployed.transformer)
            runs.append(
                {
                    "method": f"gguf {quant_type}",
                    "backend": "diffusers GGUFLinear",
                    "psnr_db": round(psnr(run["frames"], reference["frames"]), 2),
                    "max_abs_diff_uint8": int((run["frames"].int() - reference["frames"].int()).abs().max()),
                    "dit_parameter_bytes": gguf_bytes,
                    "bytes_ratio_vs_bf16": round(gguf_bytes / bf16_bytes, 4),
                    "file_bytes": gguf_file(gguf_model / "transformer").stat().st_size,
                    "denoise_s": round(run["denoise_s"], 2),
                    **({"quality_all": quality(run["videos"], cases)} if demo else {}),
                }
            )

    print(
        json.dumps(
            {
                "benchmark": "dit_weight_only_quantization",
                "preset": args.preset,
                "request": {**request, "num_inference_steps": steps, "videos": len(seeds)},
                "compute_dtype": args.dtype,
                "frames_shape": list(reference["frames"].shape),
                "reference": {
                    "dit_parameter_bytes_bf16": bf16_bytes,
                    "denoise_s": round(reference["denoise_s"], 2),
                    **{k: reference[k] for k in ("quality_all", "fp32_psnr_db", "fp32_quality_all") if k in reference},
                },
                "runs": runs,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
