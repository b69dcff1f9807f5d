"""The "ltx-2-config" and "ltx-2.3-config" presets: the published configs of Lightricks/LTX-2 (LTX-2.0) and
Lightricks/LTX-2.3 in diffusers' layout with random bf16 weights: the joint audio-video transformer (48 blocks,
19B parameters), Gemma-3-12B (12.2B with its SigLIP tower), the text connectors, the video VAE, the audio VAE and
the vocoder (LTX2Vocoder in LTX-2.0, LTX2VocoderWithBWE in LTX-2.3). The Gemma tokenizer is the "small" preset's,
trained here; the embedding table keeps Gemma's published 262208 rows. No defaults file: like a downloaded
checkpoint, it gets LTX2Pipeline's defaults (512x768, 121 frames at 24 fps, 30 steps, guidance 3.0; checkpoint.py).

The transformer and Gemma do not fit a 24 GiB machine in bf16 (38 and 24 GB), so every component is written
streamed, shard by shard (families/real_size.py `save_streamed_components`): nothing is ever held whole. About
68 GB (LTX-2.0) or 71 GB (LTX-2.3) on disk; `components` writes a part of it (the bench writes what a machine
can load).

Where each value comes from: diffusers' scripts/convert_ltx2_to_diffusers.py, which wrote the published diffusers
checkpoints. Its get_ltx2_transformer_config, get_ltx2_connectors_config, get_ltx2_video_vae_config (with
timestep_conditioning False, the script's default), get_ltx2_audio_vae_config (the same for both versions) and
get_ltx2_vocoder_config for "2.0" and "2.3" are the tables below, key for key; its scheduler for the full,
non-distilled pipeline is init_model.py's SCHEDULER_CONFIG. The text encoder is the script's default
--text_encoder_model_id, google/gemma-3-12b-it-qat-q4_0-unquantized, saved as Gemma3ForConditionalGeneration in bf16:
Gemma-3-12B's config (hidden 3840, 48 layers of 16 query and 8 key/value heads of 256, intermediate 15360, vocabulary
262208, a global layer after every five sliding-window layers of 1024, rope theta 10k local and 1M scaled linearly by
8 global; SigLIP so400m at 896 pixels without its pooling head, 256 tokens an image), as the connectors' input
width 3840 x 49 (48 layers and the embeddings) requires.

Not confirmed: the Gemma config is Google's published config.json as quoted by a third party's LTX-2 port (the
values above), not read from the hub here.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from families.base import Family
from families.init_model import save_tokenizer, write_model_index
from families.ltx2.init_model import (
    COMPONENT_CLASSES,
    GEMMA_ROPE,
    SCHEDULER_CONFIG,
    TRANSFORMER_LAYOUTS,
    VOCODER_CLASSES,
    build_tokenizer,
)
from families.real_size import Builders, save_streamed_components

LTX_2_PRESET = "ltx-2-config"
LTX_2_3_PRESET = "ltx-2.3-config"
# Each preset's layout, as families/ltx2/init_model.py names them.
PRESET_LAYOUTS = {LTX_2_PRESET: "2.0", LTX_2_3_PRESET: "2.3"}

# transformer/config.json: what both versions share; TRANSFORMER_LAYOUTS (init_model.py) adds what they set apart
# (gated attention, timestep-modulated cross-attention, the caption projection, STG's perturbed attention).
REAL_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20,
    base_height=2048,
    base_width=2048,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    audio_scale_factor=4,
    audio_pos_embed_max_pos=20,
    audio_sampling_rate=16000,
    audio_hop_length=160,
    num_layers=48,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=3840,
    attention_bias=True,
    attention_out_bias=True,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_offset=1,
    timestep_scale_multiplier=1000,
    cross_attn_timestep_scale_multiplier=1000,
    rope_type="split",
)

# connectors/config.json: LTX-2.0's two 2-layer connectors as wide as Gemma (30 heads of 128) after one shared text
# projection; LTX-2.3's 8-layer connectors with the heads of the stream each feeds and a projection per modality.
_CONNECTORS_SHARED: dict[str, Any] = dict(
    caption_channels=3840,
    text_proj_in_factor=49,
    video_connector_num_learnable_registers=128,
    audio_connector_num_learnable_registers=128,
    connector_rope_base_seq_len=4096,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_temporal_positioning=False,
    rope_type="split",
)
REAL_CONNECTORS_CONFIGS: dict[str, dict[str, Any]] = {
    "2.0": dict(
        _CONNECTORS_SHARED,
        video_connector_num_attention_heads=30,
        video_connector_attention_head_dim=128,
        video_connector_num_layers=2,
        video_gated_attn=False,
        audio_connector_num_attention_heads=30,
        audio_connector_attention_head_dim=128,
        audio_connector_num_layers=2,
        audio_gated_attn=False,
        per_modality_projections=False,
        proj_bias=False,
    ),
    "2.3": dict(
        _CONNECTORS_SHARED,
        video_connector_num_attention_heads=32,
        video_connector_attention_head_dim=128,
        video_connector_num_layers=8,
        video_gated_attn=True,
        audio_connector_num_attention_heads=32,
        audio_connector_attention_head_dim=64,
        audio_connector_num_layers=8,
        audio_gated_attn=True,
        per_modality_projections=True,
        video_hidden_dim=4096,
        audio_hidden_dim=2048,
        proj_bias=True,
    ),
}

# vae/config.json: 128 latent channels, 32x spatial and 8x temporal compression; LTX-2.3 narrows the encoder's last
# block and decodes with four upsamplers (its decoder's widths and layers differ).
_VAE_SHARED: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=128,
    down_block_types=("LTX2VideoDownBlock3D",) * 4,
    spatio_temporal_scaling=(True, True, True, True),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    timestep_conditioning=False,
    patch_size=4,
    patch_size_t=1,
    resnet_norm_eps=1e-6,
    encoder_causal=True,
    decoder_causal=False,
    encoder_spatial_padding_mode="zeros",
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)
REAL_VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "2.0": dict(
        _VAE_SHARED,
        block_out_channels=(256, 512, 1024, 2048),
        decoder_block_out_channels=(256, 512, 1024),
        layers_per_block=(4, 6, 6, 2, 2),
        decoder_layers_per_block=(5, 5, 5, 5),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual=(True, True, True),
        upsample_factor=(2, 2, 2),
        decoder_spatial_padding_mode="reflect",
    ),
    "2.3": dict(
        _VAE_SHARED,
        block_out_channels=(256, 512, 1024, 1024),
        decoder_block_out_channels=(256, 512, 512, 1024),
        layers_per_block=(4, 6, 4, 2, 2),
        decoder_layers_per_block=(4, 6, 4, 2, 2),
        decoder_spatio_temporal_scaling=(True, True, True, True),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
        upsample_residual=(False, False, False, False),
        upsample_factor=(2, 2, 1, 2),
        decoder_spatial_padding_mode="zeros",
    ),
}

# audio_vae/config.json, the same in both versions: stereo mel spectrograms of 64 bins at 16 kHz with a hop of 160,
# 8 latent channels (8 x 16 = 128 packed features, the transformer's audio_in_channels).
REAL_AUDIO_VAE_CONFIG: dict[str, Any] = dict(
    base_channels=128,
    output_channels=2,
    ch_mult=(1, 2, 4),
    num_res_blocks=2,
    attn_resolutions=None,
    in_channels=2,
    resolution=256,
    latent_channels=8,
    norm_type="pixel",
    causality_axis="height",
    dropout=0.0,
    mid_block_add_attention=False,
    sample_rate=16000,
    mel_hop_length=160,
    is_causal=True,
    mel_bins=64,
    double_z=True,
)

# vocoder/config.json: LTX2Vocoder at 24 kHz (2.0); LTX2VocoderWithBWE (2.3), 16 kHz with anti-aliased SnakeBeta
# activations, bandwidth-extended to 48 kHz.
REAL_VOCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "2.0": dict(
        in_channels=128,
        hidden_channels=1024,
        out_channels=2,
        upsample_kernel_sizes=[16, 15, 8, 4, 4],
        upsample_factors=[6, 5, 2, 2, 2],
        resnet_kernel_sizes=[3, 7, 11],
        resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        act_fn="leaky_relu",
        leaky_relu_negative_slope=0.1,
        antialias=False,
        final_act_fn="tanh",
        final_bias=True,
        output_sampling_rate=24000,
    ),
    "2.3": dict(
        in_channels=128,
        hidden_channels=1536,
        out_channels=2,
        upsample_kernel_sizes=[11, 4, 4, 4, 4, 4],
        upsample_factors=[5, 2, 2, 2, 2, 2],
        resnet_kernel_sizes=[3, 7, 11],
        resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        act_fn="snakebeta",
        leaky_relu_negative_slope=0.1,
        antialias=True,
        antialias_ratio=2,
        antialias_kernel_size=12,
        final_act_fn=None,
        final_bias=False,
        bwe_in_channels=128,
        bwe_hidden_channels=512,
        bwe_out_channels=2,
        bwe_upsample_kernel_sizes=[12, 11, 4, 4, 4],
        bwe_upsample_factors=[6, 5, 2, 2, 2],
        bwe_resnet_kernel_sizes=[3, 7, 11],
        bwe_resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        bwe_act_fn="snakebeta",
        bwe_leaky_relu_negative_slope=0.1,
        bwe_antialias=True,
        bwe_antialias_ratio=2,
        bwe_antialias_kernel_size=12,
        bwe_final_act_fn=None,
        bwe_final_bias=False,
        filter_length=512,
        hop_length=80,
        window_length=512,
        num_mel_channels=64,
        input_sampling_rate=16000,
        output_sampling_rate=48000,
    ),
}

# text_encoder/config.json: Gemma-3-12B (Gemma3ForConditionalGeneration). A global layer after every five
# sliding-window ones; rope per layer type as init_model.py's GEMMA_ROPE (Gemma-3-12B's).
REAL_GEMMA3_TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=262208,
    hidden_size=3840,
    intermediate_size=15360,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    query_pre_attn_scalar=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    sliding_window=1024,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
    attention_bias=False,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
REAL_GEMMA3_VISION_CONFIG: dict[str, Any] = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    image_size=896,
    patch_size=14,
    layer_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
    vision_use_head=False,
)
# Gemma 3's image tokens and end-of-turn ids (the published vocabulary's, past the locally trained tokenizer's).
REAL_GEMMA3_TOKENS: dict[str, Any] = dict(
    mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000, image_token_index=262144
)


def gemma3_12b_config() -> Any:
    """Gemma-3-12B's Gemma3Config."""
    from transformers import Gemma3Config

    text_config = dict(REAL_GEMMA3_TEXT_CONFIG, rope_parameters=GEMMA_ROPE)
    return Gemma3Config(text_config=text_config, vision_config=dict(REAL_GEMMA3_VISION_CONFIG), **REAL_GEMMA3_TOKENS)


def real_size_builders(preset: str) -> Builders:
    """The preset's weighted components, each a function building it (on the meta device, by the caller)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
    from transformers import Gemma3ForConditionalGeneration

    if preset not in PRESET_LAYOUTS:
        raise ValueError(f"{preset!r} is not an LTX-2 real-size preset ({', '.join(PRESET_LAYOUTS)})")
    layout = PRESET_LAYOUTS[preset]
    vocoder = LTX2Vocoder if layout == "2.0" else LTX2VocoderWithBWE
    return {
        "text_encoder": lambda: Gemma3ForConditionalGeneration(gemma3_12b_config()),
        "connectors": lambda: LTX2TextConnectors(**REAL_CONNECTORS_CONFIGS[layout]),
        "transformer": lambda: LTX2VideoTransformer3DModel(**REAL_TRANSFORMER_CONFIG, **TRANSFORMER_LAYOUTS[layout]),
        "vae": lambda: AutoencoderKLLTX2Video(**REAL_VAE_CONFIGS[layout]),
        "audio_vae": lambda: AutoencoderKLLTX2Audio(**REAL_AUDIO_VAE_CONFIG),
        "vocoder": lambda: vocoder(**REAL_VOCODER_CONFIGS[layout]),
    }


def write_real_size_checkpoint(
    family: Family,
    out: Path,
    preset: str,
    seed: int,
    save_kwargs: dict[str, Any],
    components: Collection[str] | None = None,
) -> None:
    """The tokenizer, the weighted components (those named in `components`, every one when None) streamed, the
    scheduler and model_index.json (naming every component, written or not)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    save_tokenizer(build_tokenizer("small"), out)
    builders = real_size_builders(preset)
    if components is not None:
        unknown = set(components) - set(builders)
        if unknown:
            raise ValueError(f"{preset} has no component {', '.join(sorted(unknown))}; it has {', '.join(builders)}")
        builders = {name: build for name, build in builders.items() if name in components}
    save_streamed_components(out, builders, seed, save_kwargs)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(out / "scheduler")
    write_model_index(out, family, {**COMPONENT_CLASSES, "vocoder": VOCODER_CLASSES[PRESET_LAYOUTS[preset]]})
