"""Random-weight FLUX.2 klein checkpoints in the published diffusers layout (`--family flux2-klein`).

Flux2Transformer2DModel, AutoencoderKLFlux2 and Qwen3ForCausalLM with a Qwen2-style byte-level BPE tokenizer
trained locally (families/qwen_image/init_model.py build_tokenizer) and given a chat template that renders a
user's message as Qwen3's does, thinking off included; written by `write_checkpoint`, the preset tables below
sizing every component. "tiny" and "small" are the step-distilled kind (model_index.json `is_distilled: true`,
as FLUX.2-klein ships), "tiny-base" the base kind (FLUX.2-klein-base: not distilled, CFG). The tiny sizes are odd
on purpose: 48x80 images are 3x5 = 15 image tokens, which 2 and 4 ranks split only with padding.

Flux2KleinPipeline stacks the hidden states after Qwen3's layers 9, 18 and 27, so every Qwen3 here has at least
27 layers, however narrow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.init_model import save_component, save_tokenizer, write_default_request, write_model_index
from families.qwen_image.init_model import SPECIAL_TOKENS, TOKENIZER_CONFIGS, build_tokenizer

# Flux2Transformer2DModel. Keys are the model's own config keys.
#   in_channels          4 * the VAE's latent_channels: the 2x2 patch
#   num_layers           double-stream blocks (5 in FLUX.2-klein 4B)
#   num_single_layers    single-stream blocks (20 in FLUX.2-klein 4B)
#   num_attention_heads  heads; 4, so Ulysses over 2 and 4 ranks divides them
#   attention_head_dim   width of one head; equals sum(axes_dims_rope), four axes (t, h, w, l)
#   joint_attention_dim  3 * Qwen3's hidden_size: three layers' hidden states side by side
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        patch_size=1,
        in_channels=32,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=48,
        timestep_guidance_channels=32,
        mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4),
    ),
    "small": dict(
        patch_size=1,
        in_channels=128,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=32,
        num_attention_heads=8,
        joint_attention_dim=192,
        timestep_guidance_channels=64,
        mlp_ratio=3.0,
        axes_dims_rope=(8, 8, 8, 8),
    ),
}
# FLUX.2 klein is step-distilled, not guidance-distilled: no guidance embedding, the pipeline passes none.
TRANSFORMER_COMMON: dict[str, Any] = dict(rope_theta=2000, eps=1e-6, guidance_embeds=False)

# AutoencoderKLFlux2: four levels (8x), 2x2 patches normalised by a batch norm over 4 * latent_channels channels.
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4, latent_channels=8),
    "small": dict(block_out_channels=[32, 64, 64, 64], layers_per_block=1, norm_num_groups=16, latent_channels=32),
}
VAE_COMMON: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    batch_norm_eps=1e-4,
    patch_size=[2, 2],
)

# Qwen3ForCausalLM (text_encoder); hidden_size is a third of the transformer's joint_attention_dim.
TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=28, num_attention_heads=2, num_key_value_heads=1
    ),
    "small": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=28, num_attention_heads=4, num_key_value_heads=2
    ),
}
TEXT_ENCODER_HEAD_DIM = 8

# Qwen3's chat template for what Flux2KleinPipeline renders (one user message, the generation prompt, thinking
# off), written here: each message between <|im_start|> and <|im_end|>, then the assistant's turn with an empty
# thinking block when `enable_thinking` is false.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# The rendering of one user message, its prefix (checked to tokenize to 3 tokens) and the rest around the text.
CHAT_RENDERING = ("<|im_start|>user\n", "{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 3)
# Qwen3's thinking markers: added tokens of its tokenizer (not special: they are not skipped when decoding).
THINKING_TOKENS = ["<think>", "</think>"]

# FlowMatchEulerDiscreteScheduler as FLUX.2 klein configures it: the shift `mu` is given per request
# (the pipeline's empirical one) and applied exponentially.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    time_shift_type="exponential",
    use_dynamic_shifting=True,
)

# The request each size is sized for, of the distilled kind: no guidance (the pipeline would ignore it). The base
# kind's runs CFG (BASE_GUIDANCE), as FLUX.2-klein-base is run.
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=1.0),
    "small": dict(height=256, width=256, num_frames=1, num_inference_steps=4, guidance_scale=1.0),
}
BASE_GUIDANCE = 4.0

# model_index.json entries as in the published FLUX.2 klein checkpoints.
COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Qwen3ForCausalLM"),
    "tokenizer": ("transformers", "Qwen2TokenizerFast"),
    "transformer": ("diffusers", "Flux2Transformer2DModel"),
    "vae": ("diffusers", "AutoencoderKLFlux2"),
}


def write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Tokenizer, Qwen3 text encoder, transformer, VAE, scheduler, model_index.json and defaults file."""
    if preset.endswith("-config"):
        from families.flux2_klein.real_size import write_real_size_checkpoint

        write_real_size_checkpoint(family, out, preset, seed, save_kwargs)
        return
    base = preset.endswith("-base")
    size = preset.removesuffix("-base")
    tokenizer = build_chat_tokenizer(size)
    save_tokenizer(tokenizer, out)

    torch.manual_seed(seed)
    save_component(build_text_encoder(size, tokenizer), out, "text_encoder", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_transformer(size), out, "transformer", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_vae(size, seed), out, "vae", save_kwargs)
    build_scheduler().save_pretrained(out / "scheduler")

    write_model_index(out, family, COMPONENT_CLASSES, is_distilled=not base)
    request = DEFAULT_REQUESTS[size] | (dict(guidance_scale=BASE_GUIDANCE) if base else {})
    write_default_request(out, family, request)


def build_chat_tokenizer(size: str) -> Any:
    """The locally trained Qwen2-style BPE (trained with the chat rendering, so its markers are single tokens),
    Qwen3's thinking markers and the chat template."""
    tokenizer = build_tokenizer(**TOKENIZER_CONFIGS[size], templates=(CHAT_RENDERING,))
    tokenizer.add_tokens(THINKING_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_transformer(size: str) -> torch.nn.Module:
    """The size's Flux2Transformer2DModel with freshly initialised weights (diffusers zero-initialises none)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(**TRANSFORMER_CONFIGS[size], **TRANSFORMER_COMMON).eval()


def build_vae(size: str, seed: int) -> torch.nn.Module:
    """The size's AutoencoderKLFlux2, its batch-norm statistics drawn from `seed` (a fresh batch norm's are 0 and
    1, which would leave the pipeline's de-normalisation untested)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(**VAE_COMMON, **VAE_CONFIGS[size]).eval()
    stats = torch.Generator().manual_seed(seed)
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(torch.randn(channels, generator=stats) * 0.5)
    vae.bn.running_var.copy_((1.0 + 2.0 * torch.rand(channels, generator=stats)) ** 2)
    return vae


def build_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def build_text_encoder(size: str, tokenizer: Any) -> torch.nn.Module:
    """The size's Qwen3ForCausalLM, its token ids matching `tokenizer` (embeddings tied, as Qwen3-4B's)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        head_dim=TEXT_ENCODER_HEAD_DIM,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **TEXT_ENCODER_CONFIGS[size],
    )
    return Qwen3ForCausalLM(config).eval()
