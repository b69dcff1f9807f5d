"""Random-weight Qwen-Image checkpoints in the published diffusers layout (`--family qwen-image`).

QwenImageTransformer2DModel, AutoencoderKLQwenImage, a Qwen2.5-VL text encoder and a byte-level BPE
(Qwen2) tokenizer, written by `write_checkpoint`; the preset tables below size every component.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

import torch

from families.base import Family
from families.init_model import (
    save_component,
    save_tokenizer,
    training_corpus,
    vae_with_latent_statistics,
    write_default_request,
    write_model_index,
)

# QwenImageTransformer2DModel (the MMDiT). Keys are the model's own config keys.
#   patch_size           2x2 latent patches, packed into the sequence (as in the real model)
#   in_channels          4 * the VAE's z_dim: the packed 2x2 patch of latent channels
#   out_channels         the VAE's z_dim
#   num_layers           double-stream blocks (60 in the real model)
#   num_attention_heads  heads; divisible by 2 so CFG-parallel and later head splits stay possible
#   attention_head_dim   width of one head; equals sum(axes_dims_rope)
#   joint_attention_dim  width of the text embeddings, equal to the text encoder's hidden_size
#   axes_dims_rope       RoPE widths for (frame, row, column); each even
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ),
    "small": dict(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=6,
        attention_head_dim=32,
        num_attention_heads=8,
        joint_attention_dim=128,
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    ),
}

# AutoencoderKLQwenImage; the same keys as AutoencoderKLWan's (families/wan/presets.py VAE_CONFIGS).
# Latent statistics are drawn from the seed (families.init_model).
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        dropout=0.0,
    ),
    "small": dict(
        base_dim=24,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        dropout=0.0,
    ),
}

# Qwen2_5_VLForConditionalGeneration (the text encoder). QwenImagePipeline uses only the language model's
# last hidden state; the vision tower must exist (the class builds it) and is kept minimal.
#   text: hidden_size (= the transformer's joint_attention_dim), layers, heads, key/value heads,
#         feed-forward width, and mrope_section, which splits head_dim / 2 rotary pairs over (t, h, w)
#   vision: the ViT's depth/width/heads; out_hidden_size is the text hidden_size
TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        text=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            mrope_section=[2, 1, 1],
        ),
        vision=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, fullatt_block_indexes=[0]),
    ),
    "small": dict(
        text=dict(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            mrope_section=[4, 6, 6],
        ),
        vision=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, fullatt_block_indexes=[0]),
    ),
}


class TokenizerConfig(TypedDict):
    vocab_size: int
    corpus_sentences: int
    corpus_names: int


# The locally trained byte-level BPE (Qwen2 tokenizer); the corpus and these keys:
# families.init_model.training_corpus.
TOKENIZER_CONFIGS: dict[str, TokenizerConfig] = {
    "tiny": TokenizerConfig(vocab_size=2000, corpus_sentences=6000, corpus_names=2000),
    "small": TokenizerConfig(vocab_size=8000, corpus_sentences=12000, corpus_names=12000),
}

# Qwen2.5's special tokens: the chat template's markers (which QwenImagePipeline's prompt template uses) and
# the vision markers the text encoder's config names. <|endoftext|> is the pad and end-of-text token.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# QwenImagePipeline's prompt template and the number of its leading tokens it drops (its
# prompt_template_encode_start_idx): the template prefix must tokenize to exactly that many tokens, as it
# does with the real tokenizer, so that the pipeline drops the template and keeps the prompt.
PROMPT_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
PROMPT_DROP_TOKENS = 34
# A pipeline's template for the tokenizer: its prefix (what the pipeline drops), the rest with "{}" for the
# prompt, and the number of tokens the prefix must come to.
PROMPT_TEMPLATE = (PROMPT_TEMPLATE_PREFIX, "{}<|im_end|>\n<|im_start|>assistant\n", PROMPT_DROP_TOKENS)

# FlowMatchEulerDiscreteScheduler configured as in the published Qwen-Image checkpoint: the shift `mu` is
# computed per request from the image's sequence length (dynamic shifting, exponential time shift) and
# the sigmas are stretched to end at shift_terminal.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    invert_sigmas=False,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    stochastic_sampling=False,
    time_shift_type="exponential",
    use_beta_sigmas=False,
    use_dynamic_shifting=True,
    use_exponential_sigmas=False,
    use_karras_sigmas=False,
)

# The request each preset is sized for (QwenImagePipeline keyword arguments; guidance_scale is its
# true_cfg_scale). One image: num_frames is always 1.
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=4.0),
    "small": dict(height=256, width=256, num_frames=1, num_inference_steps=8, guidance_scale=4.0),
}

# model_index.json entries as in the published Qwen-Image checkpoint.
COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "transformer": ("diffusers", "QwenImageTransformer2DModel"),
    "vae": ("diffusers", "AutoencoderKLQwenImage"),
}


def write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Tokenizer, Qwen2.5-VL text encoder, transformer, VAE, scheduler, model_index.json and defaults file."""
    tokenizer = build_tokenizer(**TOKENIZER_CONFIGS[preset])
    save_tokenizer(tokenizer, out)

    torch.manual_seed(seed)
    save_component(build_text_encoder(preset, tokenizer), out, "text_encoder", save_kwargs)

    torch.manual_seed(seed)
    save_component(build_transformer(preset), out, "transformer", save_kwargs)

    torch.manual_seed(seed)
    save_component(build_vae(preset, seed), out, "vae", save_kwargs)

    build_scheduler().save_pretrained(out / "scheduler")

    write_model_index(out, family, COMPONENT_CLASSES)
    write_default_request(out, family, DEFAULT_REQUESTS[preset])


def build_transformer(preset: str) -> torch.nn.Module:
    """The preset's QwenImageTransformer2DModel with freshly initialised weights."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(**TRANSFORMER_CONFIGS[preset]).eval()


def build_vae(preset: str, seed: int) -> torch.nn.Module:
    """The preset's AutoencoderKLQwenImage, with latent statistics drawn from `seed`."""
    from diffusers import AutoencoderKLQwenImage

    return vae_with_latent_statistics(AutoencoderKLQwenImage, VAE_CONFIGS[preset], seed)


def build_text_encoder(preset: str, tokenizer: Any) -> torch.nn.Module:
    """The preset's Qwen2_5_VLForConditionalGeneration, its token ids matching `tokenizer`."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    sizes = TEXT_ENCODER_CONFIGS[preset]
    text = dict(sizes["text"])
    mrope_section = text.pop("mrope_section")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **text,
    )
    vision_config = dict(out_hidden_size=text["hidden_size"], **sizes["vision"])
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_scheduler() -> Any:
    """The dynamically shifted flow-matching Euler scheduler Qwen-Image ships with."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def build_tokenizer(
    vocab_size: int,
    corpus_sentences: int,
    corpus_names: int,
    templates: tuple[tuple[str, str, int], ...] = (PROMPT_TEMPLATE,),
) -> Any:
    """A Qwen2-style byte-level BPE tokenizer trained on the built-in corpus, saved as Qwen2Tokenizer.

    The normaliser (NFC), pre-tokeniser (Qwen2's split regex, then byte-level) and decoder are exactly
    what `Qwen2Tokenizer` builds around a vocabulary and merges, so the class reloads it unchanged. The
    corpus includes each of `templates` (QwenImagePipeline's prompt template unless told otherwise), so
    that each template's prefix tokenizes to the tokens its pipeline drops (checked here).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    trained = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    trained.normalizer = normalizers.NFC()
    trained.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trained.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = training_corpus(corpus_sentences, corpus_names)
    # Each template as its pipeline fills it, repeated so its words become single tokens.
    lines = corpus[:200]
    for prefix, rest, _ in templates:
        corpus += [(prefix + rest).format(line) for line in lines] * 5
    trained.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=131072,
    )
    for prefix, _, drop_tokens in templates:
        prefix_ids = tokenizer(prefix)["input_ids"]
        if len(prefix_ids) != drop_tokens:
            pieces = tokenizer.convert_ids_to_tokens(prefix_ids)
            raise RuntimeError(
                f"the prompt template prefix tokenized to {len(prefix_ids)} tokens, not {drop_tokens}: {pieces}"
            )
    return tokenizer
