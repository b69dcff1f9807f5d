"""LTX-2 references shared by the tests of its decoder (tests/integration/test_ltx2_decode.py) and of its stages
(tests/integration/test_ltx2_stages.py), of image-to-video (tests/integration/test_family_ltx2_i2v.py) and of a cluster
(tests/e2e/test_ltx2_cluster.py): the prompts, a tiny checkpoint, LTX2Pipeline (or LTX2ImageToVideoPipeline) end to
end with the latents its own decoders received, the family's text encoder's tensors as the DiT stage takes them, and
the frame check."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline
from PIL import Image

from families.base import Family
from families.ltx2.encode import LTX2PromptEncoder
from families.ltx2.family import LTX2
from families.ltx2.init_model import write_checkpoint
from stagekit.denoise import DenoiseSpec

CPU = torch.device("cpu")
PROMPT = "A red fox trots across a snowy field at dawn, its breath rising in small white clouds"
NEGATIVE = "worst quality, inconsistent motion, blurry, jittery, distorted"
MAX_SEQUENCE_LENGTH = 1024
FRAME_RATE = 24.0


def tiny_checkpoint(preset: str, tmp_path_factory: pytest.TempPathFactory, family: Family = LTX2) -> Path:
    """An LTX-2 checkpoint of `preset` ("tiny": LTX-2.3's layout, "tiny-2.0": LTX-2.0's), seed 0, its model_index.json
    naming `family`'s pipeline (the weights are the same for image-to-video)."""
    out = tmp_path_factory.mktemp(f"{family.name}-{preset}")
    with torch.random.fork_rng(devices=[]):
        write_checkpoint(family, out, preset, 0, {})
    return out


def reference_pipeline(model: Path, image_to_video: bool = False) -> Any:
    """LTX2Pipeline, or LTX2ImageToVideoPipeline, from the checkpoint."""
    pipeline_class = LTX2ImageToVideoPipeline if image_to_video else LTX2Pipeline
    pipeline = pipeline_class.from_pretrained(model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@dataclass
class PipelineRun:
    """LTX2Pipeline's output (frames float [1, F, H, W, 3] in [0, 1], audio [1, channels, samples]) and the
    de-normalised latents its video VAE and audio VAE decoded (what the DiT stage sends the VAE stage)."""

    output: Any
    video_latents: torch.Tensor
    audio_latents: torch.Tensor


def run_pipeline(pipeline: Any, spec: DenoiseSpec, image: Image.Image | None = None) -> PipelineRun:
    """LTX2Pipeline end to end from PROMPT, NEGATIVE and the spec's seed (its fps, 0: FRAME_RATE), output_type
    "np"; LTX2ImageToVideoPipeline with `image` as the first frame (at its default CRF)."""
    first_frame = {} if image is None else {"image": image}
    received: dict[str, torch.Tensor] = {}
    vae_decode, audio_decode = pipeline.vae.decode, pipeline.audio_vae.decode

    def video(latents: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        received["video"] = latents.detach().clone()
        return vae_decode(latents, *args, **kwargs)

    def audio(latents: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        received["audio"] = latents.detach().clone()
        return audio_decode(latents, *args, **kwargs)

    pipeline.vae.decode, pipeline.audio_vae.decode = video, audio
    try:
        output = pipeline(
            **first_frame,
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            height=spec.height,
            width=spec.width,
            num_frames=spec.num_frames,
            frame_rate=spec.fps or FRAME_RATE,
            num_inference_steps=spec.num_inference_steps,
            guidance_scale=spec.guidance_scale,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            generator=torch.Generator("cpu").manual_seed(spec.seed),
            output_type="np",
        )
    finally:
        del pipeline.vae.decode, pipeline.audio_vae.decode
    return PipelineRun(output, received["video"], received["audio"])


def conditioning(model: Path) -> dict[str, torch.Tensor]:
    """The family's text encoder's tensors for PROMPT and NEGATIVE, named as the DiT stage takes them."""
    encoder = LTX2PromptEncoder(model, "ltx-2-tiny", CPU, torch.float32)
    tensors, _ = encoder.encode([PROMPT, NEGATIVE], MAX_SEQUENCE_LENGTH)
    return {
        f"{role}_{name}": tensor[index : index + 1]
        for index, role in enumerate(("prompt", "negative_prompt"))
        for name, tensor in tensors.items()
    }


def compare_frames(label: str, ours: torch.Tensor, theirs: np.ndarray) -> None:
    """uint8 frames [F, H, W, 3] against the pipeline's float frames [F, H, W, 3] in [0, 1]: within one level."""
    assert ours.dtype == torch.uint8 and tuple(ours.shape) == theirs.shape
    levels = torch.from_numpy(theirs * 255).round().to(torch.int16)
    difference = (ours.to(torch.int16) - levels).abs()
    print(
        f"{label}: frames {tuple(ours.shape)}, max {int(difference.max())} levels, {int((difference > 0).sum())} "
        f"of {difference.numel()} values differ"
    )
    assert int(difference.max()) <= 1
    # Random weights still give frames that vary, so a decode of the wrong latents would not pass.
    assert float(levels.float().std()) > 5
