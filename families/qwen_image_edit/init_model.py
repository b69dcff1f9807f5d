"""Random-weight Qwen-Image-Edit checkpoints in the published diffusers layout (`--family qwen-image-edit`,
`--family qwen-image-edit-plus`).

Qwen-Image's components (families/qwen_image/init_model.py: the transformer, the VAE, the scheduler, the
Qwen2.5-VL text encoder and its byte-level BPE tokenizer, imported with their tables, which this module
re-exports so that every table its checkpoints are sized by can be read here) and a `processor`, the
Qwen2VLProcessor the edit pipelines run the prompt and the input images through: the same tokenizer and a
Qwen2VLImageProcessor whose pixel bounds keep the vision tower to a few patches. The tokenizer is trained
on the edit pipelines' prompt template too, so that its system prefix comes to the 64 tokens the pipelines
drop. model_index.json is the published Qwen/Qwen-Image-Edit's (Qwen-Image-Edit-2509's for Plus); the two
differ in the pipeline class only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from families.base import Family
from families.init_model import save_component, save_tokenizer, write_default_request, write_model_index
from families.qwen_image.init_model import COMPONENT_CLASSES as QWEN_COMPONENT_CLASSES
from families.qwen_image.init_model import (
    PROMPT_TEMPLATE,
    TOKENIZER_CONFIGS,
    build_scheduler,
    build_text_encoder,
    build_tokenizer,
    build_transformer,
    build_vae,
)
from families.qwen_image.init_model import TEXT_ENCODER_CONFIGS as TEXT_ENCODER_CONFIGS
from families.qwen_image.init_model import TRANSFORMER_CONFIGS as TRANSFORMER_CONFIGS
from families.qwen_image.init_model import VAE_CONFIGS as VAE_CONFIGS
from families.qwen_image_edit.encode import EDIT_DROP_TOKENS, EDIT_TEMPLATE_PREFIX, EDIT_TEMPLATE_REST

# Qwen2VLImageProcessor (the processor's image side). The edit pipelines hand it each image at about
# 1024x1024 (Edit) or 384x384 (Plus) pixels; it resizes it to a multiple of patch_size * merge_size = 28
# within [min_pixels, max_pixels], and the vision tower sees one token per 2x2 of its 14x14 patches.
#   min_pixels, max_pixels  the bounds on the resized image (3136 and 12845056 in the published checkpoints)
#   patch_size, temporal_patch_size, merge_size  the vision tower's (Qwen2_5_VLVisionConfig defaults)
PROCESSOR_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, temporal_patch_size=2, merge_size=2),
    "small": dict(min_pixels=56 * 56, max_pixels=224 * 224, patch_size=14, temporal_patch_size=2, merge_size=2),
}

# The request each preset is sized for. The output's size comes from the input image (about 1024x1024),
# so only the steps and the true_cfg_scale matter; 1024x1024 applies when no image gives a size.
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=1024, width=1024, num_frames=1, num_inference_steps=2, guidance_scale=4.0),
    "small": dict(height=1024, width=1024, num_frames=1, num_inference_steps=8, guidance_scale=4.0),
}

# model_index.json entries as in the published Qwen-Image-Edit checkpoints.
COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    **QWEN_COMPONENT_CLASSES,
    "processor": ("transformers", "Qwen2VLProcessor"),
}

# The edit pipelines' template, for the tokenizer: Qwen-Image's template is trained too, so that the
# tokenizer is Qwen-Image's for its prompts as well.
EDIT_TEMPLATE = (EDIT_TEMPLATE_PREFIX, EDIT_TEMPLATE_REST, EDIT_DROP_TOKENS)


def write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Tokenizer, processor, Qwen2.5-VL text encoder, transformer, VAE, scheduler, model_index.json, defaults."""
    import torch

    tokenizer = build_tokenizer(**TOKENIZER_CONFIGS[preset], templates=(PROMPT_TEMPLATE, EDIT_TEMPLATE))
    save_tokenizer(tokenizer, out)
    write_processor(preset, tokenizer, out / "processor")

    torch.manual_seed(seed)
    save_component(build_text_encoder(preset, tokenizer), out, "text_encoder", save_kwargs)

    torch.manual_seed(seed)
    save_component(build_transformer(preset), out, "transformer", save_kwargs)

    torch.manual_seed(seed)
    save_component(build_vae(preset, seed), out, "vae", save_kwargs)

    build_scheduler().save_pretrained(out / "scheduler")

    write_model_index(out, family, COMPONENT_CLASSES)
    write_default_request(out, family, DEFAULT_REQUESTS[preset])


def write_processor(preset: str, tokenizer: Any, directory: Path) -> None:
    """The preset's processor directory: `tokenizer` and a Qwen2VLImageProcessor with the preset's pixel bounds.

    These are the files `Qwen2VLProcessor.from_pretrained` reads (its video processor, which the edit
    pipelines never use, is made from the image processor's config). The processor itself is not built
    here: transformers builds a Qwen2VLProcessor only where torchvision is installed
    (families/qwen_image_edit/encode.py `load_processor`).
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.save_pretrained(directory)
    # The PIL image processor is what `Qwen2VLImageProcessor` gives without torchvision; its config names
    # Qwen2VLImageProcessor, as the published checkpoints' does.
    Qwen2VLImageProcessorPil(**PROCESSOR_CONFIGS[preset]).save_pretrained(directory)
