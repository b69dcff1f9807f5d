"""Random-weight FLUX.1 Kontext checkpoints in the published diffusers layout (`--family flux-kontext`).

FLUX.1-dev's components, built by families/flux/init_model.py's builders with its tables (the tokenizers,
CLIP, T5, the guidance-distilled transformer, the dev scheduler): only model_index.json (FluxKontextPipeline,
as black-forest-labs/FLUX.1-Kontext-dev names it), the tiny VAE and the default requests are Kontext's own.

Every reference image is resized to about a megapixel (the pipeline's preferred resolutions), so the tiny
preset's AutoencoderKL has six narrow levels (32x, where FLUX.1's has four, 8x; 4 channels at full resolution):
its image then packs into about 256 tokens, not 4,096, a megapixel encodes in about a second on a CPU, and its
outputs are multiples of 64 pixels. Everything else about it is FLUX.1's VAE
(16 latent channels, a scale and a shift); "small" keeps FLUX.1's 8x.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.flux.init_model import (
    COMPONENT_CLASSES,
    VAE_COMMON,
    build_clip,
    build_clip_tokenizer,
    build_scheduler,
    build_t5,
    build_transformer,
)
from families.flux.init_model import TEXT_ENCODER_CONFIGS as TEXT_ENCODER_CONFIGS
from families.flux.init_model import TOKENIZER_CONFIGS as TOKENIZER_CONFIGS
from families.flux.init_model import TRANSFORMER_CONFIGS as TRANSFORMER_CONFIGS
from families.flux.init_model import VAE_CONFIGS as FLUX_VAE_CONFIGS
from families.init_model import save_component, write_default_request, write_model_index
from families.wan.components import build_tokenizer as build_t5_tokenizer

# AutoencoderKL: FLUX.1's common config with these levels (2 ** (levels - 1) the spatial factor).
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        block_out_channels=[4, 4, 4, 8, 8, 16],
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=["DownEncoderBlock2D"] * 6,
        up_block_types=["UpDecoderBlock2D"] * 6,
    ),
    "small": FLUX_VAE_CONFIGS["small"],
}

# The request each preset is sized for when it sends no image (with one, the output takes the image's
# resized size); FluxKontextPipeline's guidance 3.5 embedded, true CFG off. 128x192 packs into 2x3 tokens
# of the tiny VAE's 32x latents.
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        height=128, width=192, num_frames=1, num_inference_steps=2, guidance_scale=1.0, embedded_guidance_scale=3.5
    ),
    "small": dict(
        height=256, width=256, num_frames=1, num_inference_steps=8, guidance_scale=1.0, embedded_guidance_scale=3.5
    ),
}


def build_vae(size: str) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(**{**VAE_COMMON, **VAE_CONFIGS[size]}).eval()


def write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Both tokenizers and text encoders, transformer, VAE, scheduler, model_index.json and defaults file; the
    text encoders, tokenizers and transformer are FLUX.1-dev's preset of the same name and seed."""
    vocab_size, sentences, names = TOKENIZER_CONFIGS[preset]
    clip_tokenizer = build_clip_tokenizer(vocab_size, sentences, names)
    clip_tokenizer.save_pretrained(out / "tokenizer")
    t5_tokenizer = build_t5_tokenizer(vocab_size, sentences, names)
    t5_tokenizer.save_pretrained(out / "tokenizer_2")

    torch.manual_seed(seed)
    save_component(build_clip(preset, clip_tokenizer), out, "text_encoder", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_t5(preset, len(t5_tokenizer)), out, "text_encoder_2", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_transformer(preset, guidance_embeds=True), out, "transformer", save_kwargs)
    build_scheduler("dev").save_pretrained(out / "scheduler")
    write_kontext_parts(family, out, preset, seed, save_kwargs)


def write_kontext_parts(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """What Kontext's checkpoint of a preset has that FLUX.1-dev's of the same preset and seed has not: the
    VAE, model_index.json and the defaults file (the tests make the tiny checkpoint from FLUX.1-dev's this way,
    training its tokenizers once)."""
    torch.manual_seed(seed)
    save_component(build_vae(preset), out, "vae", save_kwargs)
    write_model_index(out, family, COMPONENT_CLASSES)
    write_default_request(out, family, DEFAULT_REQUESTS[preset])
