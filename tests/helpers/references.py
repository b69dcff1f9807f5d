"""Reference outputs from diffusers' own pipelines, for the parity checks."""

from __future__ import annotations

import numpy as np
import torch


def reference_frames(pipeline, *, prompt, negative_prompt, height, width, num_frames, steps, guidance, seed):
    """WanPipeline's frames for the arguments, converted to uint8 [F, H, W, 3]."""
    output = pipeline(
        prompt=prompt,
        negative_prompt=negative_prompt,
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    ).frames[0]
    return (np.clip(output, 0, 1) * 255).round().astype(np.uint8)
