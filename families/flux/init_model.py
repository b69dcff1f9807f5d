"""Random-weight FLUX.1 checkpoints in the published diffusers layout (`--family flux`).

FluxTransformer2DModel, AutoencoderKL, CLIPTextModel with a CLIP-style BPE tokenizer and T5EncoderModel with a
T5-style Unigram tokenizer, both trained locally, written by `write_checkpoint`; the preset tables below size every
component. "tiny" is FLUX.1-dev's kind (guidance-distilled: a guidance embedding), "tiny-schnell" FLUX.1-schnell's
(none, and schnell's fixed-shift scheduler). The tiny sizes are odd on purpose: 3 latent channels' worth of patch
rows the degree does not divide exercise padding in the parallel tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.init_model import save_component, training_corpus, write_default_request, write_model_index
from families.wan.components import build_tokenizer as build_t5_tokenizer

# FluxTransformer2DModel. Keys are the model's own config keys.
#   in_channels          4 * the VAE's latent_channels: the packed 2x2 patch
#   num_layers           double-stream (MMDiT) blocks (19 in FLUX.1)
#   num_single_layers    single-stream blocks (38 in FLUX.1)
#   num_attention_heads  heads; 4, so Ulysses over 2 and 4 ranks divides them
#   attention_head_dim   width of one head; equals sum(axes_dims_rope)
#   joint_attention_dim  width of T5's embeddings (its d_model)
#   pooled_projection_dim  width of CLIP's pooled output (its hidden_size)
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=24,
        axes_dims_rope=(4, 6, 6),
    ),
    "small": dict(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=32,
        num_attention_heads=8,
        joint_attention_dim=128,
        pooled_projection_dim=64,
        axes_dims_rope=(8, 12, 12),
    ),
}

# AutoencoderKL as FLUX.1 ships it (16 latent channels, no quant convs, a scale and a shift); four levels, so 8x.
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4),
    "small": dict(block_out_channels=[32, 64, 64, 64], layers_per_block=1, norm_num_groups=16),
}
VAE_COMMON: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    latent_channels=16,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=True,
)

# CLIPTextModel (text_encoder; hidden_size is the transformer's pooled_projection_dim) and T5EncoderModel
# (text_encoder_2; d_model is its joint_attention_dim, gated-GELU as T5 v1.1).
TEXT_ENCODER_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": dict(
        clip=dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2),
        t5=dict(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4),
    ),
    "small": dict(
        clip=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
        t5=dict(d_model=128, d_kv=32, d_ff=256, num_layers=3, num_heads=4),
    ),
}
# The locally trained tokenizers: (vocab_size, corpus_sentences, corpus_names), families.init_model.training_corpus.
TOKENIZER_CONFIGS: dict[str, tuple[int, int, int]] = {"tiny": (1000, 3000, 1000), "small": (4000, 8000, 4000)}
# CLIP's specials and its 77-token window.
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
CLIP_MAX_LENGTH = 77

# FlowMatchEulerDiscreteScheduler as the published checkpoints configure it: dev shifts by the image's token
# count (dynamic shifting), schnell by a fixed 1.0.
SCHEDULER_CONFIGS: dict[str, dict[str, Any]] = {
    "dev": dict(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
    ),
    "schnell": dict(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=False,
    ),
}

# The request each preset is sized for (guidance_scale is FluxPipeline's true_cfg_scale, off;
# embedded_guidance_scale its guidance_scale, for dev). 48x80 packs into 3x5 tokens, which 2 and 4 do not divide.
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=1.0, embedded_guidance_scale=3.5
    ),
    "small": dict(
        height=256, width=256, num_frames=1, num_inference_steps=8, guidance_scale=1.0, embedded_guidance_scale=3.5
    ),
}

# FLUX.1-schnell's kind takes no embedded guidance.
SCHNELL_DEFAULT_REQUEST: dict[str, Any] = dict(
    height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=1.0
)

# model_index.json entries as in the published FLUX.1 checkpoints.
COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "CLIPTextModel"),
    "text_encoder_2": ("transformers", "T5EncoderModel"),
    "tokenizer": ("transformers", "CLIPTokenizer"),
    "tokenizer_2": ("transformers", "T5TokenizerFast"),
    "transformer": ("diffusers", "FluxTransformer2DModel"),
    "vae": ("diffusers", "AutoencoderKL"),
}


def write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Both tokenizers and text encoders, transformer, VAE, scheduler, model_index.json and defaults file."""
    if preset.endswith("-config"):
        from families.flux.real_size import write_real_size_checkpoint

        write_real_size_checkpoint(family, out, preset, seed, save_kwargs)
        return
    schnell = preset.endswith("-schnell")
    size = preset.removesuffix("-schnell")
    vocab_size, sentences, names = TOKENIZER_CONFIGS[size]
    clip_tokenizer = build_clip_tokenizer(vocab_size, sentences, names)
    clip_tokenizer.save_pretrained(out / "tokenizer")
    t5_tokenizer = build_t5_tokenizer(vocab_size, sentences, names)
    t5_tokenizer.save_pretrained(out / "tokenizer_2")

    torch.manual_seed(seed)
    save_component(build_clip(size, clip_tokenizer), out, "text_encoder", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_t5(size, len(t5_tokenizer)), out, "text_encoder_2", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_transformer(size, guidance_embeds=not schnell), out, "transformer", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_vae(size), out, "vae", save_kwargs)
    build_scheduler("schnell" if schnell else "dev").save_pretrained(out / "scheduler")

    write_model_index(out, family, COMPONENT_CLASSES)
    write_default_request(out, family, SCHNELL_DEFAULT_REQUEST if schnell else DEFAULT_REQUESTS[size])


def build_transformer(size: str, guidance_embeds: bool) -> torch.nn.Module:
    """The size's FluxTransformer2DModel with freshly initialised weights; the final layers drawn too (diffusers
    zero-initialises none of FLUX's, but the draw keeps every output depending on every block)."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(**TRANSFORMER_CONFIGS[size], guidance_embeds=guidance_embeds).eval()


def build_vae(size: str) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(**VAE_COMMON, **VAE_CONFIGS[size]).eval()


def build_scheduler(kind: str) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS[kind])


def build_clip(size: str, tokenizer: Any) -> torch.nn.Module:
    """CLIPTextModel whose pooled output reads the end-of-text token's position, as CLIP's does."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=CLIP_MAX_LENGTH,
        bos_token_id=tokenizer.convert_tokens_to_ids(CLIP_BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(CLIP_EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(CLIP_EOS),
        hidden_act="quick_gelu",
        **TEXT_ENCODER_CONFIGS[size]["clip"],
    )
    return CLIPTextModel(config).eval()


def build_t5(size: str, vocab_size: int) -> torch.nn.Module:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        is_encoder_decoder=False,
        **TEXT_ENCODER_CONFIGS[size]["t5"],
    )
    return T5EncoderModel(config).eval()


def build_clip_tokenizer(vocab_size: int, corpus_sentences: int, corpus_names: int) -> Any:
    """A CLIP-style byte-level BPE ("</w>" ending each word) trained on the built-in corpus, saved as CLIPTokenizer.

    CLIPTokenizer builds its own normaliser, pre-tokeniser and start/end post-processor around a vocabulary and
    merges; only those are trained here, with the same byte-level alphabet and end-of-word suffix.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    trained = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    trained.normalizer = normalizers.Lowercase()
    trained.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[CLIP_BOS, CLIP_EOS],
        initial_alphabet=alphabet,
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    trained.train_from_iterator(training_corpus(corpus_sentences, corpus_names), trainer=trainer)
    merges = [
        tuple(m) if isinstance(m, list) else tuple(m.split(" "))
        for m in json.loads(trained.to_str())["model"]["merges"]
    ]
    # The trainer numbers the characters it starts from in hash order, which differs from run to run; the merges
    # come out the same. Number the vocabulary from them: the specials, every byte alone and ending a word (CLIP's
    # vocabulary has both forms of each), then each merge's result in merge order.
    tokens = [CLIP_BOS, CLIP_EOS, *sorted(alphabet), *(char + "</w>" for char in sorted(alphabet))]
    tokens += [left + right for left, right in merges]
    vocab = {token: index for index, token in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)
