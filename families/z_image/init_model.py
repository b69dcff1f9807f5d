"""Random-weight Z-Image checkpoints in the published diffusers layout (`--family z-image`).

ZImageTransformer2DModel, AutoencoderKL (FLUX.1's, families/flux/init_model.py), a Qwen3Model text encoder and a
Qwen2-style byte-level BPE tokenizer trained locally with a chat template of its own, written by
`write_checkpoint`; the preset tables below size every component. "tiny" and "small" are Z-Image's kind (the base
model's scheduler, CFG), "tiny-turbo" Z-Image-Turbo's (its scheduler shift, no CFG): the two published
checkpoints differ in nothing else their configs show. ZImageTransformer2DModel pads the image and the caption
to multiples of 32 tokens itself, so no image size makes 2 or 4 ranks pad; the tiny sizes keep one noise refiner
block (its split and gather on one block) and an image of 15 patches, which the model pads to 32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.flux.init_model import VAE_CONFIGS as FLUX_VAE_CONFIGS
from families.flux.init_model import build_vae
from families.init_model import save_component, save_tokenizer, write_default_request, write_model_index
from families.qwen_image.init_model import SPECIAL_TOKENS, build_tokenizer

# ZImageTransformer2DModel. Keys are the model's own config keys.
#   in_channels       the VAE's latent_channels (2x2 patches are taken inside the model)
#   dim, n_heads      width and heads; dim / n_heads = sum(axes_dims); 4 heads, so Ulysses over 2 and 4 divides them
#   n_layers          main single-stream blocks (30 in Z-Image)
#   n_refiner_layers  blocks of each of the noise and context refiners (2 in Z-Image)
#   cap_feat_dim      width of the text encoder's hidden states (its hidden_size)
#   axes_dims         rotary widths for (caption/frame position, row, column); each even
#   axes_lens         positions of each rotary axis: the first bounds caption length + 1
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=64,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        cap_feat_dim=32,
        axes_dims=[4, 6, 6],
        axes_lens=[1024, 64, 64],
    ),
    "small": dict(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=256,
        n_layers=4,
        n_refiner_layers=2,
        n_heads=8,
        n_kv_heads=8,
        cap_feat_dim=128,
        axes_dims=[8, 12, 12],
        axes_lens=[1536, 128, 128],
    ),
}

# Qwen3Model: hidden_size is the transformer's cap_feat_dim; ZImagePipeline takes the second-to-last hidden state.
TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
    ),
    "small": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
    ),
}

# The locally trained byte-level BPE: (vocab_size, corpus_sentences, corpus_names), families.init_model.training_corpus.
TOKENIZER_CONFIGS: dict[str, tuple[int, int, int]] = {"tiny": (2000, 6000, 2000), "small": (8000, 12000, 12000)}

# A chat template of our own with what ZImagePipeline asks of Qwen3's: each message in <|im_start|>role ...
# <|im_end|> markers, then the assistant's turn when a generation prompt is asked for, with an empty thinking
# block only when thinking is turned off (the pipeline turns it on, so none is added).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
# The template around one user message, as the tokenizer is trained on it: its prefix tokenizes to 3 tokens
# (<|im_start|>, "user", the newline), checked when the tokenizer is built.
TEMPLATE = ("<|im_start|>user\n", "{}<|im_end|>\n<|im_start|>assistant\n", 3)

# FlowMatchEulerDiscreteScheduler with a fixed shift, as the published checkpoints configure it: Z-Image-Turbo's
# 3.0 (families/z_image/checkpoint.py tells the two apart by it), the base model's 6.0.
SCHEDULER_SHIFTS = {"base": 6.0, "turbo": 3.0}

# The request each preset is sized for (ZImagePipeline keyword arguments). 48x80 is 3x5 patches of 2x2 latents.
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=4.0),
    "small": dict(height=256, width=256, num_frames=1, num_inference_steps=8, guidance_scale=4.0),
}

# Z-Image-Turbo's kind runs without CFG.
TURBO_DEFAULT_REQUEST: dict[str, Any] = dict(
    height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=0.0
)
# AutoencoderKL as FLUX.1 ships it, sized by FLUX.1's table (build_vae).
VAE_CONFIGS = FLUX_VAE_CONFIGS

# model_index.json entries as in the published Z-Image checkpoints.
COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Qwen3Model"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "transformer": ("diffusers", "ZImageTransformer2DModel"),
    "vae": ("diffusers", "AutoencoderKL"),
}


def write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Tokenizer, Qwen3 text encoder, transformer, VAE, scheduler, model_index.json and defaults file."""
    if preset.endswith("-config"):
        from families.z_image.real_size import write_real_size_checkpoint

        write_real_size_checkpoint(family, out, preset, seed, save_kwargs)
        return
    turbo = preset.endswith("-turbo")
    size = preset.removesuffix("-turbo")
    tokenizer = build_chat_tokenizer(size)
    save_tokenizer(tokenizer, out)

    torch.manual_seed(seed)
    save_component(build_text_encoder(size, tokenizer), out, "text_encoder", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_transformer(size), out, "transformer", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_vae(size), out, "vae", save_kwargs)
    build_scheduler("turbo" if turbo else "base").save_pretrained(out / "scheduler")

    write_model_index(out, family, COMPONENT_CLASSES)
    write_default_request(out, family, TURBO_DEFAULT_REQUEST if turbo else DEFAULT_REQUESTS[size])


def build_chat_tokenizer(size: str) -> Any:
    """The size's Qwen2-style tokenizer, trained with the chat template's text, carrying CHAT_TEMPLATE."""
    vocab_size, sentences, names = TOKENIZER_CONFIGS[size]
    tokenizer = build_tokenizer(vocab_size, sentences, names, templates=(TEMPLATE,))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_transformer(size: str) -> torch.nn.Module:
    """The size's ZImageTransformer2DModel; its pad tokens (zeros in diffusers) drawn too, so that the tokens the
    model pads with weigh in every output."""
    from diffusers import ZImageTransformer2DModel

    model = ZImageTransformer2DModel(**TRANSFORMER_CONFIGS[size]).eval()
    with torch.no_grad():
        model.x_pad_token.normal_()
        model.cap_pad_token.normal_()
    return model


def build_text_encoder(size: str, tokenizer: Any) -> torch.nn.Module:
    """The size's Qwen3Model, its token ids matching `tokenizer`."""
    from transformers import Qwen3Config, Qwen3Model

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **TEXT_ENCODER_CONFIGS[size],
    )
    return Qwen3Model(config).eval()


def build_scheduler(kind: str) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=SCHEDULER_SHIFTS[kind], use_dynamic_shifting=False
    )
