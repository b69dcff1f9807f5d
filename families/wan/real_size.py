"""The "wan2.1-1.3b-config" preset: Wan-AI/Wan2.1-T2V-1.3B-Diffusers' configs and shard layout with random
bf16 weights (about 7B parameters: a 5.7B UMT5-XXL encoder, a 1.3B transformer), so that memory, load times and
startup are measured at real size. Each module is built on the meta device, materialised in bf16 and filled
tensor by tensor, so no float32 copy of anything is ever held.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.init_model import save_component, save_tokenizer, write_model_index
from families.real_size import random_bf16
from families.wan.components import build_scheduler, build_tokenizer
from families.wan.presets import COMPONENT_CLASSES, TOKENIZER_CONFIGS

REAL_SIZE_PRESET = "wan2.1-1.3b-config"

# transformer/config.json of Wan2.1-T2V-1.3B-Diffusers (hidden size 12 x 128 = 1536, 30 blocks).
REAL_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)

# text_encoder/config.json: google/umt5-xxl's encoder, with its real vocabulary (256384 embedding rows), so
# that the parameter count (5.7B) and bytes are the real ones. The locally trained tokenizer uses the first
# rows only.
REAL_TEXT_ENCODER_CONFIG: dict[str, Any] = dict(
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_decoder_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dense_act_fn="gelu_new",
    is_gated_act=True,
    layer_norm_epsilon=1e-6,
    dropout_rate=0.1,
    classifier_dropout=0.0,
    initializer_factor=1.0,
    scalable_attention=True,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)

# vae/config.json: Wan2.1's VAE with its published per-channel latent statistics (they are also diffusers'
# AutoencoderKLWan defaults).
REAL_VAE_CONFIG: dict[str, Any] = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    latents_mean=[
        -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
        0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
    ],
    latents_std=[
        2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
        3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
    ],
)  # fmt: skip

# The published checkpoint is float32 with shards of at most 5 GB: 5 text encoder shards, 2 transformer
# shards, one VAE file. Half that limit in bf16 splits the same tensors into the same shards.
REAL_SIZE_SHARD_BYTES = 2_500_000_000


def write_real_size_checkpoint(
    family: Family, out: Path, seed: int, save_kwargs: dict[str, Any], config_from: Path | None = None
) -> None:
    """The "wan2.1-1.3b-config" checkpoint: published configs and shard layout, random bf16 weights.

    One component at a time is built on the meta device, materialised in bf16, filled and saved, then
    dropped; the largest (the 11.4 GB text encoder) is the peak. The tokenizer is the "small" preset's
    locally trained one. No defaults file is written: like a downloaded checkpoint, it gets the family's
    reference request defaults. `config_from` (a checkpoint directory) gives the text encoder's, transformer's,
    VAE's and scheduler's configs in place of the published 1.3B ones.
    """
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    save_kwargs = {"max_shard_size": REAL_SIZE_SHARD_BYTES, **save_kwargs}
    save_tokenizer(build_tokenizer(**TOKENIZER_CONFIGS["small"]), out)

    text_encoder_config, transformer_config, vae_config = (
        REAL_TEXT_ENCODER_CONFIG,
        REAL_TRANSFORMER_CONFIG,
        REAL_VAE_CONFIG,
    )
    if config_from is not None:
        text_encoder_config = UMT5Config.from_pretrained(config_from / "text_encoder").to_dict()
        transformer_config = dict(WanTransformer3DModel.load_config(config_from / "transformer"))
        vae_config = dict(AutoencoderKLWan.load_config(config_from / "vae"))
    with torch.device("meta"):
        text_encoder = UMT5EncoderModel(UMT5Config(**text_encoder_config))
    save_component(random_bf16(text_encoder, seed).eval(), out, "text_encoder", save_kwargs)
    del text_encoder

    with torch.device("meta"):
        transformer = WanTransformer3DModel.from_config(transformer_config)
    save_component(random_bf16(transformer, seed).eval(), out, "transformer", save_kwargs)
    del transformer

    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config(vae_config)
    save_component(random_bf16(vae, seed).eval(), out, "vae", save_kwargs)
    del vae

    scheduler = build_scheduler()
    if config_from is not None:
        scheduler = type(scheduler).from_pretrained(config_from / "scheduler")
    scheduler.save_pretrained(out / "scheduler")
    write_model_index(out, family, dict(COMPONENT_CLASSES))
