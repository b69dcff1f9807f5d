"""The Wan presets' tables: each component's config per preset ("tiny", "small"), the tokenizer's size, the
scheduler, the request each preset is sized for, and the model_index.json classes.

Keys are the models' own config keys, so a table entry reads as the config.json it becomes.
"""

from __future__ import annotations

from typing import Any, TypedDict

# WanTransformer3DModel (the DiT). Keys are the model's own config keys.
#   patch_size          (t, h, w) patch over the latent video; (1, 2, 2) as in every Wan2.1 model
#   num_attention_heads heads per attention; divisible by 2 and 4 so Ulysses/tensor parallelism can split them
#   attention_head_dim  width of one head; hidden size = heads * head_dim
#   in/out_channels     latent channels, equal to the VAE's z_dim
#   text_dim            width of the text embeddings, equal to the text encoder's d_model
#   freq_dim            sinusoidal timestep embedding width (256 in the real models)
#   ffn_dim             hidden width of each block's feed-forward
#   num_layers          number of transformer blocks
#   cross_attn_norm     layer-norm before cross-attention, as in the real models
#   qk_norm             RMS norm of queries and keys across all heads, as in the real models
#   rope_max_seq_len    longest positional extent (frames, rows, columns of patches) RoPE covers (1024 as in
#                       the real models; its tables are not saved weights)
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    ),
    "small": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=8,
        attention_head_dim=48,
        in_channels=16,
        out_channels=16,
        text_dim=128,
        freq_dim=256,
        ffn_dim=1536,
        num_layers=12,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    ),
}

# AutoencoderKLWan (the causal 3D VAE). Keys are the model's own config keys.
#   base_dim            channels of the first encoder stage (96 in the real model)
#   z_dim               latent channels
#   dim_mult            channel multiplier per resolution stage
#   num_res_blocks      residual blocks per stage
#   attn_scales         resolutions with spatial attention (none, as in the real model)
#   temperal_downsample which of the three downsamplings also halve time (4x overall, as in the real model)
# latents_mean / latents_std are not fixed here: they are drawn from the seed (families.init_model).
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    ),
    "small": dict(
        base_dim=24,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    ),
}

# UMT5EncoderModel (the text encoder); UMT5Config keys. vocab_size is not set here: it is the size of
# the tokenizer trained for the checkpoint, so every token id has an embedding row.
#   d_model                 hidden width (= the transformer's text_dim)
#   d_kv                    width of one attention head
#   d_ff                    feed-forward hidden width
#   num_layers / num_heads  encoder depth and heads
#   relative_attention_*    T5 relative position buckets
#   feed_forward_proj       gated GELU feed-forward, as in UMT5
#   pad/eos/decoder_start   token ids matching the tokenizer (<pad>=0, </s>=1)
TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_gated_act=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    ),
    "small": dict(
        d_model=128,
        d_kv=32,
        d_ff=256,
        num_layers=4,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_gated_act=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    ),
}


class TokenizerConfig(TypedDict):
    """The keyword arguments of `families.wan.components.build_tokenizer`."""

    vocab_size: int
    corpus_sentences: int
    corpus_names: int


# The locally trained Unigram tokenizer (the corpus and these keys: families.init_model.training_corpus).
# The trainer keeps only pieces that win some segmentation of the corpus, so a larger vocabulary needs a
# more varied corpus (more made-up names).
TOKENIZER_CONFIGS: dict[str, TokenizerConfig] = {
    "tiny": TokenizerConfig(vocab_size=2000, corpus_sentences=6000, corpus_names=2000),
    "small": TokenizerConfig(vocab_size=8000, corpus_sentences=12000, corpus_names=12000),
}

# UniPCMultistepScheduler configured as in the published Wan2.1 diffusers checkpoints.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
)

# The request each preset is sized for: WanPipeline keyword arguments.
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0),
    "small": dict(height=256, width=256, num_frames=17, num_inference_steps=8, guidance_scale=5.0),
}

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as in T5/UMT5

# model_index.json entries. The published Wan2.1 checkpoints name T5TokenizerFast, but in transformers 5
# T5Tokenizer (= T5TokenizerFast) rebuilds its normaliser and pre-tokeniser on load and so would drop
# ours; the generic tokenizers-backed class, which AutoTokenizer resolves for what we save, loads
# tokenizer.json exactly as written.
COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "UniPCMultistepScheduler"),
    "text_encoder": ("transformers", "UMT5EncoderModel"),
    "tokenizer": ("transformers", "TokenizersBackend"),
    "transformer": ("diffusers", "WanTransformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLWan"),
}

# Wan2.2-T2V-A14B: `transformer` denoises while t >= boundary_ratio * num_train_timesteps, `transformer_2`
# after that (0.875 as in the published checkpoint). The second expert's weights are drawn from seed + this.
A14B_BOUNDARY_RATIO = 0.875
SECOND_EXPERT_SEED_OFFSET = 1
