"""Prompt encoding with the input images, exactly as QwenImageEditPipeline.encode_prompt (and
QwenImageEditPlusPipeline's) does it.

Qwen2.5-VL reads the prompt filled into the edit pipelines' chat template with each image's vision tokens
in it: Edit puts `<|vision_start|><|image_pad|><|vision_end|>` before the prompt, Edit-Plus a
"Picture n: ..." of them per image. The processor (Qwen2VLProcessor) expands each `<|image_pad|>` into
the image's patch tokens and makes its pixel values; the text encoder's last hidden state, less the
template's first 64 tokens (its system message), is the embedding, with the image's tokens in it. The
images the VL sees are the request's, resized first as the pipelines resize them: to about 1024x1024
pixels (Edit, the size its VAE takes) or 384x384 (Edit-Plus), keeping the aspect ratio. Unlike
QwenImagePipeline the edit pipelines do not truncate the sequence, so `max_sequence_length` plays no part.

Prompt and negative prompt are encoded one at a time with the same images, as the pipelines encode them,
and each is cached on its text and the images' SHA-256 (stagekit/encoder.py); the padding to the
longest text and the masks are Qwen-Image's (families/qwen_image/encode.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
from transformers.utils import is_torchvision_available

from families.base import calculate_dimensions
from families.qwen_image.encode import QwenPromptEncoder
from families.qwen_image_edit.family import IMAGE_SIDE_MULTIPLE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS, VAE_IMAGE_AREA
from families.registry import family_for_index
from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.encoder import Truncation
from stagekit.errors import RequestError

# The edit pipelines' prompt_template_encode, split where the user's turn starts: the prefix is what their
# prompt_template_encode_start_idx (64) drops; the rest takes the images' vision tokens and the prompt.
EDIT_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
EDIT_TEMPLATE_REST = "{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_DROP_TOKENS = 64
VISION_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class EditPrompt:
    """How a variant shows its images to the VL: the text before the prompt for image n (from 1), and the
    area the pipeline resizes each image to first."""

    image_text: str
    condition_area: int

    def text(self, prompt: str, images: int) -> str:
        """The prompt filled into the template as the pipeline fills it."""
        return EDIT_TEMPLATE_PREFIX + EDIT_TEMPLATE_REST.format(
            "".join(self.image_text.format(n + 1) for n in range(images)) + prompt
        )


PROMPTS = {
    # QwenImageEditPipeline: the one image, resized to the output's calculated size.
    QWEN_IMAGE_EDIT.name: EditPrompt(VISION_TOKENS, VAE_IMAGE_AREA),
    # QwenImageEditPlusPipeline: its CONDITION_IMAGE_SIZE.
    QWEN_IMAGE_EDIT_PLUS.name: EditPrompt("Picture {}: " + VISION_TOKENS, 384 * 384),
}


class _ImageTextProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor, which transformers builds only with torchvision."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(path: str | Path) -> Qwen2VLProcessor:
    """The checkpoint's `processor`, as `QwenImageEditPipeline.from_pretrained` loads it where torchvision is
    installed. Without torchvision, Qwen2VLProcessor cannot be built (its video processor needs it), and the
    same class is made from the directory's tokenizer and image processor alone: the edit pipelines pass it
    text and images only, so it gives the same tokens and pixels."""
    if is_torchvision_available():
        return Qwen2VLProcessor.from_pretrained(path)
    return _ImageTextProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path)
    )


class QwenImageEditPromptEncoder(QwenPromptEncoder):
    """Qwen2.5-VL seeing the request's images in the edit pipelines' template, on the text-encoder stage."""

    texts_see_images = True

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
        family = family_for_index(json.loads((model_dir / "model_index.json").read_text()))
        assert family is not None  # the registry chose this encoder from the checkpoint's family
        self.prompt = PROMPTS[family.name]
        self.processor = load_processor(model_dir / "processor")
        vae_config = json.loads((model_dir / "vae" / "config.json").read_text())
        # The pipelines' image processor (its resize is all that is used here: Lanczos, to a given size).
        vae_scale_factor = 2 ** len(vae_config.get("temperal_downsample", [False, True, True]))
        self.image_processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor * 2)

    def embed_uncached(self, text: str, max_sequence_length: int) -> torch.Tensor:
        raise RequestError("images: the edit pipelines encode each prompt with the input image; send it in images")

    def truncation(self, text: str, max_sequence_length: int) -> Truncation | None:
        """None: the edit pipelines cut no text."""
        return None

    def condition_image(self, image: Image.Image) -> Image.Image:
        """An input image resized as the pipeline resizes it before the VL sees it."""
        width, height = calculate_dimensions(self.prompt.condition_area, *image.size, IMAGE_SIDE_MULTIPLE)
        if width < 1 or height < 1:
            raise RequestError(
                f"images: a {image.width}x{image.height} image resizes to {width}x{height} for the text encoder; "
                "send an image with a less extreme aspect ratio"
            )
        return self.image_processor.resize(image, height, width)

    def embed_with_images_uncached(
        self, text: str, images: list[Image.Image], max_sequence_length: int
    ) -> torch.Tensor:
        """The [L, dim] embedding of one text with the images: the vision tokens and the prompt's, after the
        template's system message (`max_sequence_length` is not applied, as the pipelines do not)."""
        inputs = self.processor(
            text=[self.prompt.text(text, len(images))],
            images=[self.condition_image(image) for image in images],
            padding=True,
            return_tensors="pt",
        ).to(self.device)
        output = self.text_encoder(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            output_hidden_states=True,
        )
        hidden = output.hidden_states[-1][0]
        # _extract_masked_hidden for a batch of one, then the template's system message dropped.
        hidden = hidden[inputs["attention_mask"][0].bool()][EDIT_DROP_TOKENS:]
        # A copy of its own, so that the cache holds these rows only.
        return hidden.to(self.text_encoder.dtype).cpu().clone()
