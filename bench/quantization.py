"""Frames from an fp8 / int8 weight-only quantized DiT against the unquantized one, in one run.

Every configuration denoises the same seed and the same (random, seeded) text embeddings
for a few steps with WanDenoiser in the compute dtype, then WanStreamingDecoder decodes the
latents in float32; the report gives the PSNR of each quantized run's uint8 frames against
the unquantized run's, and the DiT's parameter bytes against the bf16 model (loaded as the
stage loads it: bf16 with the model's float32-kept modules). Prints JSON.

    python bench/quantization.py [--preset small] [--steps 4] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path

import torch

from dit_svc.denoise import DenoiseSpec
from dit_svc.quantization import METHODS, parameter_bytes, quantize_transformer, torchao_available
from families.init_model import init_model
from families.wan.decode import WanStreamingDecoder
from families.wan.denoise import WanDenoiser
from families.wan.init_model import DEFAULT_REQUESTS

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CPU = torch.device("cpu")


def psnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    mse = (actual.double() - expected.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def generate(model: Path, spec: DenoiseSpec, dtype: torch.dtype, method: str | None, backend: str) -> dict:
    denoiser = WanDenoiser(model, CPU, dtype)
    report = quantize_transformer(denoiser.transformer, method, [], backend=backend) if method else None
    generator = torch.Generator().manual_seed(1)
    conditioning = {
        "prompt_embeds": torch.randn(1, 32, denoiser.text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 32, denoiser.text_dim, generator=generator),
    }
    started = time.perf_counter()
    latents = denoiser.denoise(spec, conditioning, on_step=lambda i, n: None, cancelled=lambda: False)
    seconds = time.perf_counter() - started
    session = WanStreamingDecoder(model, CPU, torch.float32).session()
    frames = torch.cat([session.decode_next(latents[:, :, t : t + 1]) for t in range(latents.shape[2])])
    return {"frames": frames, "denoise_s": seconds, "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--model", help="existing checkpoint (default: make one with init-model)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--backends", default="native,torchao" if torchao_available() else "native")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else init_model("wan-t2v", args.preset, Path(tmp) / args.preset, seed=0)
        request = DEFAULT_REQUESTS[args.preset]
        spec = DenoiseSpec(
            height=request["height"],
            width=request["width"],
            num_frames=request["num_frames"],
            num_inference_steps=args.steps,
            guidance_scale=request["guidance_scale"],
            seed=0,
        )
        dtype = DTYPES[args.dtype]
        bf16_bytes = parameter_bytes(WanDenoiser(model, CPU, torch.bfloat16).transformer)
        reference = generate(model, spec, dtype, None, "native")
        runs = []
        for backend in args.backends.split(","):
            for method in METHODS:
                run = generate(model, spec, dtype, method, backend)
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
                    }
                )

    print(
        json.dumps(
            {
                "benchmark": "dit_weight_only_quantization",
                "preset": args.preset,
                "request": {**request, "num_inference_steps": args.steps, "seed": 0},
                "compute_dtype": args.dtype,
                "frames_shape": list(reference["frames"].shape),
                "reference": {"dit_parameter_bytes_bf16": bf16_bytes, "denoise_s": round(reference["denoise_s"], 2)},
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
