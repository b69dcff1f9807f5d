"""The "flux.1-dev-config" and "flux.1-schnell-config" presets: FLUX.1's published configs with random bf16
weights (families/real_size.py writes them): a 12B transformer, T5-v1.1-XXL's 4.8B encoder, CLIP-L's 123M and the
16-channel AutoencoderKL, about 34 GB on disk. The tokenizers are the "small" preset's, trained here; the
embedding tables keep their published rows. No defaults file: like a downloaded checkpoint, it gets the family's
reference defaults (dev's or schnell's, by its transformer's guidance_embeds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from families.base import Family
from families.flux.init_model import (
    COMPONENT_CLASSES,
    TOKENIZER_CONFIGS,
    VAE_COMMON,
    build_clip_tokenizer,
    build_scheduler,
)
from families.init_model import write_model_index
from families.real_size import Builders, save_real_size_components
from families.wan.components import build_tokenizer as build_t5_tokenizer

# transformer/config.json of FLUX.1-dev (schnell's differs in guidance_embeds only): 19 double-stream and 38
# single-stream blocks of 24 heads of 128.
REAL_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    axes_dims_rope=(16, 56, 56),
)
# text_encoder/config.json: openai/clip-vit-large-patch14's text tower.
REAL_CLIP_CONFIG: dict[str, Any] = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    projection_dim=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
)
# text_encoder_2/config.json: google/t5-v1_1-xxl's encoder.
REAL_T5_CONFIG: dict[str, Any] = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
)
# vae/config.json: four levels of 128, 256, 512, 512 channels, two resnets each.
REAL_VAE_CONFIG: dict[str, Any] = dict(
    **VAE_COMMON, block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32
)


def real_size_builders(preset: str, tokenizer: Any | None = None) -> Builders:
    """The preset's weighted components, each a function building it (on the meta device, by the caller);
    `tokenizer` (the CLIP one) gives the end-of-text id CLIP's pooled output reads (None: 1, the id ours has)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    eos = 1 if tokenizer is None else tokenizer.eos_token_id
    return {
        "text_encoder": lambda: CLIPTextModel(
            CLIPTextConfig(**REAL_CLIP_CONFIG, eos_token_id=eos, pad_token_id=eos, bos_token_id=0)
        ),
        "text_encoder_2": lambda: T5EncoderModel(T5Config(**REAL_T5_CONFIG)),
        "transformer": lambda: FluxTransformer2DModel(
            **REAL_TRANSFORMER_CONFIG, guidance_embeds=preset != "flux.1-schnell-config"
        ),
        "vae": lambda: AutoencoderKL(**REAL_VAE_CONFIG),
    }


def write_real_size_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    clip_tokenizer = build_clip_tokenizer(*TOKENIZER_CONFIGS["small"])
    clip_tokenizer.save_pretrained(out / "tokenizer")
    build_t5_tokenizer(*TOKENIZER_CONFIGS["small"]).save_pretrained(out / "tokenizer_2")
    save_real_size_components(out, real_size_builders(preset, clip_tokenizer), seed, save_kwargs)
    build_scheduler("schnell" if preset == "flux.1-schnell-config" else "dev").save_pretrained(out / "scheduler")
    write_model_index(out, family, COMPONENT_CLASSES)
