"""Which denoiser a checkpoint's family runs; the DiT service and every rank of its group ask here."""

from __future__ import annotations

from pathlib import Path

import torch

from dit_svc.denoise import WanDenoiser
from dit_svc.model_options import ModelOptions
from dit_svc.parallel import ParallelConfig
from dit_svc.qwen_denoise import QwenImageDenoiser
from services.checkpoint import read_checkpoint

Denoiser = WanDenoiser | QwenImageDenoiser


def make_denoiser(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelConfig | None = None,
    options: ModelOptions | None = None,
    load_threads: int = 4,
) -> Denoiser:
    """The family's denoiser: QwenImageDenoiser for qwen-image, WanDenoiser for the Wan families."""
    if read_checkpoint(model_dir).family == "qwen-image":
        return QwenImageDenoiser(
            model_dir, device, dtype, parallel=parallel, options=options, load_threads=load_threads
        )
    return WanDenoiser(model_dir, device, dtype, parallel=parallel, options=options, load_threads=load_threads)
