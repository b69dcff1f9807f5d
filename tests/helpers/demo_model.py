"""The committed demo model's prompts and diffusers' frames for them, the reference for the demo checks."""

from __future__ import annotations

import numpy as np

from shapeworld.demo_model import DEFAULT_REQUEST
from shapeworld.world import HELD_OUT_TEMPLATES, Concept
from tests.helpers.references import reference_frames

# A seen prompt, a held-out phrasing and a held-out combination ("green square moving left" is never shown in
# training; this prompt and seed are a case of bench/demo_quality.py's evaluation set); the seeds are fixed, so
# the videos are too.
PROMPTS = (
    ("a red circle moving right on a dark background", 7),
    (Concept("triangle", "yellow", "growing", "gray").prompt(HELD_OUT_TEMPLATES[0]), 3),
    ("video of a green square moving left against a striped background", 0),
)


def diffusers_frames(pipeline, prompt: str, seed: int) -> np.ndarray:
    """WanPipeline's uint8 frames at the model's default request (stagediff.json), the empty negative prompt."""
    return reference_frames(
        pipeline,
        prompt=prompt,
        negative_prompt="",
        height=DEFAULT_REQUEST["height"],
        width=DEFAULT_REQUEST["width"],
        num_frames=DEFAULT_REQUEST["num_frames"],
        steps=DEFAULT_REQUEST["num_inference_steps"],
        guidance=DEFAULT_REQUEST["guidance_scale"],
        seed=seed,
    )
