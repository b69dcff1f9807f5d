"""Conditioning of Wan2.1 image-to-video: the prompts as WanPipeline encodes them (UMT5, families/wan), and
the input images as WanImageToVideoPipeline.encode_image embeds them (CLIP vision, its penultimate layer).
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from transformers import CLIPImageProcessor, CLIPVisionModel

from families.wan.encode import WanPromptEncoder
from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.weights import load_pretrained


class WanImageConditionEncoder(WanPromptEncoder):
    """UMT5 for the prompts and CLIP vision for the images, on the text-encoder stage's device."""

    def __init__(
        self,
        model_dir: str | Path,
        model_id: str,
        device: torch.device,
        dtype: torch.dtype,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        load_threads: int = 4,
    ) -> None:
        super().__init__(model_dir, model_id, device, dtype, cache_bytes, cache_entries, load_threads)
        model_dir = Path(model_dir)
        self.image_encoder = load_pretrained(
            CLIPVisionModel, model_dir / "image_encoder", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        self.image_processor = CLIPImageProcessor.from_pretrained(model_dir / "image_processor")

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {"text_encoder": self.text_encoder, "image_encoder": self.image_encoder}

    def embed_images_uncached(self, images: list[Image.Image]) -> torch.Tensor:
        """[n, tokens, dim]: CLIP's hidden states before its last layer, one image each (first, then last frame)."""
        pixels = self.image_processor(images=images, return_tensors="pt").to(self.device)
        hidden = self.image_encoder(**pixels, output_hidden_states=True).hidden_states[-2]
        return hidden.cpu()
