"""Random-weight Qwen-Image 2.1 checkpoints in the diffusers layout of QwenImage21Pipeline (`--family qwen-image-2.1`).

QwenImage21Transformer2DModel (single-stream, block-causal), AutoencoderKLQwenImage21 (16x spatial, 64 latent
channels in the published model, RGBA pixels), a Qwen3-VL text encoder and a `processor` directory: the byte-level
BPE tokenizer of Qwen-Image (families/qwen_image/init_model.py `build_tokenizer`, trained on the same corpus), a
Qwen2VL-style image processor with Qwen3-VL's 16-pixel patches and the chat template the pipeline renders its
system message with. The scheduler is Qwen-Image's. model_index.json names the components as QwenImage21Pipeline
takes them; `sample_sigmas` is left unset, so the pipeline's linspace schedule applies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.init_model import save_component, vae_with_latent_statistics, write_default_request, write_model_index
from families.qwen_image.init_model import SPECIAL_TOKENS, TOKENIZER_CONFIGS, build_scheduler, build_tokenizer

# QwenImage21Transformer2DModel. Keys are the model's own config keys.
#   in_channels / out_channels  the VAE's z_dim: 2.1 takes the latents unpatched (patch_size 1)
#   num_layers                  single-stream blocks (32 in the published model)
#   attention_head_dim          width of one head; equals sum(axes_dims_rope)
#   num_attention_heads         heads; even, so that a later head split stays possible
#   context_in_dim              the text encoder's hidden_size
#   axes_dims_rope              RoPE widths for (frame, row, column); each even
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        patch_size=1,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        context_in_dim=32,
        mlp_ratio=3,
        axes_dims_rope=(4, 6, 6),
        causal_condition=True,
    ),
    "small": dict(
        patch_size=1,
        in_channels=16,
        out_channels=16,
        num_layers=6,
        attention_head_dim=32,
        num_attention_heads=8,
        context_in_dim=128,
        mlp_ratio=3,
        axes_dims_rope=(8, 12, 12),
        causal_condition=True,
    ),
}

# AutoencoderKLQwenImage21: five levels of dim_mult (four 2x downsamples, 16x, as scale_factor_spatial says),
# RGBA in and out as in the published model. Latent statistics are drawn from the seed (families.init_model).
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True, True],
        dropout=0.0,
        in_channels=4,
        out_channels=4,
    ),
    "small": dict(
        base_dim=16,
        decoder_base_dim=24,
        z_dim=16,
        dim_mult=[1, 2, 2, 4, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True, True],
        dropout=0.0,
        in_channels=4,
        out_channels=4,
    ),
}

# Qwen3VLForConditionalGeneration. The pipeline reads the language model's last decoder layer (before its final
# norm); the vision tower must exist (the class builds it) and is kept minimal.
#   text: hidden_size (= the transformer's context_in_dim), layers, heads, key/value heads, head_dim,
#         feed-forward width, and mrope_section, which splits head_dim / 2 rotary pairs over (t, h, w)
#   vision: the ViT's depth/width/heads; deepstack_visual_indexes must name layers below depth
TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        text=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            mrope_section=[2, 1, 1],
        ),
        vision=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, deepstack_visual_indexes=[0]),
    ),
    "small": dict(
        text=dict(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            mrope_section=[4, 6, 6],
        ),
        vision=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, deepstack_visual_indexes=[0]),
    ),
}

# The image side of the processor (Qwen3-VL: 16-pixel patches merged 2x2). Text-to-image never uses it; it is
# there so that the directory loads as the pipeline's Qwen3VLProcessor.
IMAGE_PROCESSOR_CONFIG: dict[str, Any] = dict(
    min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16, temporal_patch_size=2, merge_size=2
)

# A chat template in Qwen's ChatML form, for the messages QwenImage21Pipeline renders with it (a system message of
# text parts, to count the tokens it drops): each message "<|im_start|>{role}\n{text}<|im_end|>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The request each preset is sized for (QwenImage21Pipeline keyword arguments; guidance_scale is its
# true_cfg_scale). One image: num_frames is always 1; sides are multiples of 32.
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=4.0),
    "small": dict(height=256, width=256, num_frames=1, num_inference_steps=8, guidance_scale=4.0),
}

# model_index.json entries as QwenImage21Pipeline takes its components.
COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "transformer": ("diffusers", "QwenImage21Transformer2DModel"),
    "vae": ("diffusers", "AutoencoderKLQwenImage21"),
}


def write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Processor, Qwen3-VL text encoder, transformer, VAE, scheduler, model_index.json and defaults file."""
    tokenizer = build_tokenizer(**TOKENIZER_CONFIGS[preset])
    write_processor(tokenizer, out / "processor")

    torch.manual_seed(seed)
    save_component(build_text_encoder(preset, tokenizer), out, "text_encoder", save_kwargs)

    torch.manual_seed(seed)
    save_component(build_transformer(preset), out, "transformer", save_kwargs)

    torch.manual_seed(seed)
    save_component(build_vae(preset, seed), out, "vae", save_kwargs)

    build_scheduler().save_pretrained(out / "scheduler")

    write_model_index(out, family, COMPONENT_CLASSES)
    write_default_request(out, family, DEFAULT_REQUESTS[preset])


def write_processor(tokenizer: Any, directory: Path) -> None:
    """The processor directory: the tokenizer, the image processor's config and the chat template.

    The processor is not built here: transformers builds a Qwen3VLProcessor only where torchvision is installed
    (its video processor needs it); families/qwen_image_21/encode.py `load_processor` makes it without one.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR_CONFIG).save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def build_transformer(preset: str) -> torch.nn.Module:
    """The preset's QwenImage21Transformer2DModel with freshly initialised weights."""
    from diffusers import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel(**TRANSFORMER_CONFIGS[preset]).eval()


def build_vae(preset: str, seed: int) -> torch.nn.Module:
    """The preset's AutoencoderKLQwenImage21, with latent statistics drawn from `seed`."""
    from diffusers import AutoencoderKLQwenImage21

    return vae_with_latent_statistics(AutoencoderKLQwenImage21, VAE_CONFIGS[preset], seed)


def build_text_encoder(preset: str, tokenizer: Any) -> torch.nn.Module:
    """The preset's Qwen3VLForConditionalGeneration, its token ids matching `tokenizer`."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    sizes = TEXT_ENCODER_CONFIGS[preset]
    text = dict(sizes["text"])
    mrope_section = text.pop("mrope_section")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": mrope_section,
            "mrope_interleaved": True,
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **text,
    )
    vision_config = dict(out_hidden_size=text["hidden_size"], patch_size=16, spatial_merge_size=2, **sizes["vision"])
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen3VLForConditionalGeneration(config).eval()
