"""Random-weight Wan image-to-video checkpoints in the published diffusers layout (`--family wan-i2v`).

  wan-i2v          Wan2.1-I2V-14B: WanImageToVideoPipeline with a CLIP vision image encoder and its image
                   processor; the transformer takes 36 input channels and cross-attends to the image
  wan2.2-i2v-a14b  Wan2.2-I2V-A14B: WanImageToVideoPipeline with two expert transformers (`transformer` for
                   high noise, `transformer_2` for low noise) and `boundary_ratio`, no CLIP
                   (`image_encoder` and `image_processor` are [null, null])
  wan2.2-ti2v      Wan2.2-TI2V-5B: WanPipeline with `expand_timesteps` on and the Wan2.2 VAE (z_dim 48,
                   16x spatial compression, so heights and widths are multiples of 32 = 16 x the 2x2
                   patch); WanImageToVideoPipeline loads the same directory for image-to-video

All three are written by `write_checkpoint`, which reads the difference from the Family it is given. The
prompt side is Wan2.1's own (families/wan/components.py): the tokenizer, the UMT5 text encoder, the
scheduler and the request each preset is sized for (DEFAULT_REQUESTS; its sizes are multiples of 32, so
it serves TI2V too), imported from there with their tables, which this module re-exports so that every
table its checkpoints are sized by can be read here. The tables below size the rest, per preset and then
per family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.init_model import (
    save_component,
    save_tokenizer,
    vae_with_latent_statistics,
    write_default_request,
    write_model_index,
)
from families.wan.components import build_scheduler, build_text_encoder, build_tokenizer
from families.wan.presets import COMPONENT_CLASSES, DEFAULT_REQUESTS, SECOND_EXPERT_SEED_OFFSET, TOKENIZER_CONFIGS
from families.wan.presets import TEXT_ENCODER_CONFIGS as TEXT_ENCODER_CONFIGS
from families.wan.presets import TRANSFORMER_CONFIGS as WAN_TRANSFORMER_CONFIGS
from families.wan.presets import VAE_CONFIGS as WAN_VAE_CONFIGS

WAN_I2V, WAN22_I2V_A14B, WAN22_TI2V = "wan-i2v", "wan2.2-i2v-a14b", "wan2.2-ti2v"

# transformers.CLIPVisionModel (the Wan2.1 image encoder, a ViT-H/14 in the real model); CLIPVisionConfig
# keys. The pipeline takes its penultimate hidden state: (image_size / patch_size)^2 + 1 tokens of
# hidden_size each (257 x 1280 in the real model).
#   hidden_size          token width (= the transformer's image_dim)
#   intermediate_size    feed-forward hidden width
#   num_hidden_layers    encoder depth
#   num_attention_heads  heads per attention
#   image_size           side of the square input (224 in the real model); the image processor resizes and
#                        crops to it
#   patch_size           side of one patch (14 in the real model)
#   hidden_act           GELU, as in the real model (CLIPVisionConfig's default is quick_gelu)
IMAGE_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    ),
    "small": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=64,
        patch_size=8,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    ),
}

# transformers.CLIPImageProcessor configured as openai/clip-vit-large-patch14's preprocessor (the one the
# published Wan2.1 I2V checkpoints ship); `size` and `crop_size` are the image encoder's image_size.
#   resample  3 = PIL bicubic, for the resize of the shortest edge to image_size
#   the crop  the centre image_size x image_size square
#   rescale   pixel values by 1/255, then normalise with CLIP's per-channel mean and std
IMAGE_PROCESSOR_CONFIG: dict[str, Any] = dict(
    do_resize=True,
    resample=3,
    do_center_crop=True,
    do_rescale=True,
    rescale_factor=1 / 255,
    do_normalize=True,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
    do_convert_rgb=True,
)

# WanTransformer3DModel per preset and family: Wan2.1's table (families/wan/presets.py, where every
# key is explained) with these keys changed, as in the published checkpoints:
#   in_channels        Wan2.1 I2V and Wan2.2 I2V A14B: 36 = 16 noise latents + 4 frame-mask channels (one
#                      per frame of the 4 the VAE folds into a latent frame) + 16 latents of the conditioning
#                      video (the input image, then zeros); TI2V: 48 = the Wan2.2 VAE's z_dim (the image's
#                      latents are written over the first latent frame instead of concatenated)
#   out_channels       the VAE's z_dim (16, or 48 for TI2V)
#   image_dim          Wan2.1 I2V: width of the CLIP image tokens (= the image encoder's hidden_size);
#                      None (no image cross-attention) for the Wan2.2 models
#   added_kv_proj_dim  Wan2.1 I2V: input width of each block's image key/value projections; the image
#                      embedder maps the CLIP tokens to the hidden size first, so it is heads x head_dim;
#                      None for the Wan2.2 models
#   pos_embed_seq_len  left None, as in Wan2.1-I2V-14B (the first-last-frame model learns a position
#                      embedding over both images' CLIP tokens)
TRANSFORMER_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    preset: {
        WAN_I2V: {
            **wan,
            "in_channels": 36,
            "out_channels": 16,
            "image_dim": IMAGE_ENCODER_CONFIGS[preset]["hidden_size"],
            "added_kv_proj_dim": wan["num_attention_heads"] * wan["attention_head_dim"],
        },
        WAN22_I2V_A14B: {**wan, "in_channels": 36, "out_channels": 16, "image_dim": None, "added_kv_proj_dim": None},
        WAN22_TI2V: {**wan, "in_channels": 48, "out_channels": 48, "image_dim": None, "added_kv_proj_dim": None},
    }
    for preset, wan in WAN_TRANSFORMER_CONFIGS.items()
}

# AutoencoderKLWan in the Wan2.2 style (Wan2.2-TI2V-5B). Keys beyond Wan2.1's (families/wan/presets.py):
#   decoder_base_dim       channels of the first decoder stage (256 in the real model, 160 in its encoder)
#   z_dim                  48 latent channels
#   is_residual            residual down/up blocks with a parameter-free shortcut (average-pooling down,
#                          duplicating up) beside the convolutions
#   patch_size             2x2 pixel patches are folded into channels before the encoder and unfolded after
#                          the decoder, so in_channels = out_channels = 3 x 2 x 2 = 12
#   scale_factor_spatial   16 = the patch's 2 x the encoder's three 2x downsamplings; the pipelines read it
#   scale_factor_temporal  4, as Wan2.1's
# latents_mean / latents_std are drawn from the seed (families.init_model).
WAN22_VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        base_dim=8,
        decoder_base_dim=16,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
    ),
    "small": dict(
        base_dim=16,
        decoder_base_dim=24,
        z_dim=48,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
    ),
}

# AutoencoderKLWan per preset and family: the Wan2.1 VAE for both I2V families, the Wan2.2 VAE for TI2V.
VAE_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    preset: {
        WAN_I2V: WAN_VAE_CONFIGS[preset],
        WAN22_I2V_A14B: WAN_VAE_CONFIGS[preset],
        WAN22_TI2V: WAN22_VAE_CONFIGS[preset],
    }
    for preset in WAN_VAE_CONFIGS
}

# The pipeline config entries of model_index.json, as in the published checkpoints. Both pipelines
# register `boundary_ratio` (Wan2.2 I2V A14B: `transformer` denoises while t >= 0.9 x num_train_timesteps,
# `transformer_2` after) and `expand_timesteps` (TI2V: a per-token timestep, 0 on the given first frame).
PIPELINE_CONFIGS: dict[str, dict[str, Any]] = {
    WAN_I2V: dict(boundary_ratio=None, expand_timesteps=False),
    WAN22_I2V_A14B: dict(boundary_ratio=0.9, expand_timesteps=False),
    WAN22_TI2V: dict(boundary_ratio=None, expand_timesteps=True),
}

# Components the published checkpoints name as left out ([null, null] in model_index.json).
LEFT_OUT_COMPONENTS: dict[str, tuple[str, ...]] = {
    WAN_I2V: (),
    WAN22_I2V_A14B: ("image_encoder", "image_processor"),
    WAN22_TI2V: ("transformer_2",),
}

# model_index.json classes of the image components (the rest: families/wan/presets.py COMPONENT_CLASSES).
# In transformers 5 without torchvision, `transformers.CLIPImageProcessor` is the PIL-backed
# CLIPImageProcessorPil; either backend saves and loads the same "CLIPImageProcessor" preprocessor config.
IMAGE_COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "image_encoder": ("transformers", "CLIPVisionModel"),
    "image_processor": ("transformers", "CLIPImageProcessor"),
}


def write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Tokenizer, UMT5 text encoder, transformer(s), VAE, scheduler, the CLIP image encoder and processor
    (Wan2.1 I2V), model_index.json and the defaults file.

    A family that requires `transformer_2` gets the second expert, drawn from seed + SECOND_EXPERT_SEED_OFFSET;
    one that requires `image_encoder` gets CLIP. model_index.json is as in the published checkpoint.
    """
    tokenizer = build_tokenizer(**TOKENIZER_CONFIGS[preset])
    save_tokenizer(tokenizer, out)

    torch.manual_seed(seed)
    save_component(build_text_encoder(preset, vocab_size=len(tokenizer)), out, "text_encoder", save_kwargs)

    torch.manual_seed(seed)
    save_component(build_transformer(family, preset), out, "transformer", save_kwargs)
    components = dict(COMPONENT_CLASSES)
    if "transformer_2" in family.requires:
        # The low-noise expert gets its own seed, so the two experts differ and a switch at the wrong
        # step shows in the output.
        torch.manual_seed(seed + SECOND_EXPERT_SEED_OFFSET)
        save_component(build_transformer(family, preset), out, "transformer_2", save_kwargs)
        components["transformer_2"] = COMPONENT_CLASSES["transformer"]

    torch.manual_seed(seed)
    save_component(build_vae(family, preset, seed), out, "vae", save_kwargs)

    build_scheduler().save_pretrained(out / "scheduler")

    if "image_encoder" in family.requires:
        torch.manual_seed(seed)
        save_component(build_image_encoder(preset), out, "image_encoder", save_kwargs)
        build_image_processor(preset).save_pretrained(out / "image_processor")
        components.update(IMAGE_COMPONENT_CLASSES)

    left_out = {name: [None, None] for name in LEFT_OUT_COMPONENTS[family.name]}
    write_model_index(out, family, components, **left_out, **PIPELINE_CONFIGS[family.name])
    write_default_request(out, family, DEFAULT_REQUESTS[preset])


def build_transformer(family: Family, preset: str) -> torch.nn.Module:
    """The family's WanTransformer3DModel for the preset, with freshly initialised weights."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**TRANSFORMER_CONFIGS[preset][family.name]).eval()


def build_vae(family: Family, preset: str, seed: int) -> torch.nn.Module:
    """The family's AutoencoderKLWan for the preset, with latent statistics drawn from `seed`."""
    from diffusers import AutoencoderKLWan

    return vae_with_latent_statistics(AutoencoderKLWan, VAE_CONFIGS[preset][family.name], seed)


def build_image_encoder(preset: str) -> torch.nn.Module:
    """The preset's CLIPVisionModel with freshly initialised weights."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    return CLIPVisionModel(CLIPVisionConfig(**IMAGE_ENCODER_CONFIGS[preset])).eval()


def build_image_processor(preset: str) -> Any:
    """The CLIP image processor that resizes and crops to the preset's image encoder input."""
    from transformers import CLIPImageProcessor

    side = IMAGE_ENCODER_CONFIGS[preset]["image_size"]
    return CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}, **IMAGE_PROCESSOR_CONFIG
    )
