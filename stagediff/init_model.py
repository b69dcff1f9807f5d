"""Write random-weight checkpoints in the real diffusers layout.

No model hub is reachable where StageDiff is built and tested, so tests and benchmarks run on
checkpoints made here: the real classes (diffusers for transformer, VAE and scheduler, transformers
for the text encoder and tokenizer) with their real config keys, random weights saved as
safetensors, and a tokenizer trained locally with the `tokenizers` library. A directory written by
`init_model` loads unchanged with the family's pipeline (`diffusers.WanPipeline.from_pretrained(out_dir)`
or `diffusers.QwenImagePipeline.from_pretrained(out_dir)`), exactly as a downloaded checkpoint does, so
every stage can be checked against in-process diffusers.

Families:
  wan-t2v       Wan2.1 text-to-video: one WanTransformer3DModel
  wan2.2-a14b   Wan2.2-T2V-A14B: two WanTransformer3DModel experts (`transformer` for high noise,
                `transformer_2` for low noise) and the pipeline config entry `boundary_ratio`
  qwen-image    Qwen-Image text-to-image: QwenImageTransformer2DModel, AutoencoderKLQwenImage,
                Qwen2.5-VL text encoder and a byte-level BPE (Qwen2) tokenizer

diffusers, transformers and tokenizers are imported where they are used, so importing this module
(as the CLI does) stays cheap.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.checkpoint import DEFAULTS_FILE

logger = logging.getLogger(__name__)

FAMILIES = ("wan-t2v", "wan2.2-a14b", "qwen-image")
PRESETS = ("tiny", "small")

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
# latents_mean / latents_std are not fixed here: init_model draws them from the seed (std positive)
# so that the pipeline's de-normalisation of latents is exercised with non-trivial values.
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
# the tokenizer trained by init_model, so every token id has an embedding row.
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

# The locally trained Unigram tokenizer. The trainer keeps only pieces that win some segmentation of
# the corpus, so a larger vocabulary needs a more varied corpus (more made-up names).
#   vocab_size       target number of pieces, special tokens included (a too-plain corpus ends short)
#   corpus_sentences generated prompt-like sentences to train on
#   corpus_names     distinct made-up proper names used in them (the main source of distinct sub-words)
TOKENIZER_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=2000, corpus_sentences=6000, corpus_names=2000),
    "small": dict(vocab_size=8000, corpus_sentences=12000, corpus_names=12000),
}

# UniPCMultistepScheduler configured as in the published Wan2.1 diffusers checkpoints.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
)

# The request each preset is sized for: WanPipeline keyword arguments. Measured end to end through
# WanPipeline (CFG doubles the transformer calls), best of several runs on a shared 2-core CPU:
#   tiny,  1 thread:  ~0.15 s (transformer ~0.01 s, VAE decode ~0.1 s, text encoder ~0.04 s)
#   small, 2 threads: ~19 s   (transformer 12-13 s = 65-70%, VAE decode ~6 s = 30-33%, text encoder 0.05 s)
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0),
    "small": dict(height=256, width=256, num_frames=17, num_inference_steps=8, guidance_scale=5.0),
}

# Wan2.1 renders at 16 frames per second.
DEFAULT_FPS = 16.0

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as in T5/UMT5

# model_index.json entries. The published Wan2.1 checkpoints name T5TokenizerFast, but in transformers 5
# T5Tokenizer (= T5TokenizerFast) rebuilds its normaliser and pre-tokeniser on load and so would drop
# ours; the generic tokenizers-backed class, which AutoTokenizer resolves for what we save, loads
# tokenizer.json exactly as written.
_COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
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

# ---------------------------------------------------------------------------------------------
# Qwen-Image

# QwenImageTransformer2DModel (the MMDiT). Keys are the model's own config keys.
#   patch_size           2x2 latent patches, packed into the sequence (as in the real model)
#   in_channels          4 * the VAE's z_dim: the packed 2x2 patch of latent channels
#   out_channels         the VAE's z_dim
#   num_layers           double-stream blocks (60 in the real model)
#   num_attention_heads  heads; divisible by 2 so CFG-parallel and later head splits stay possible
#   attention_head_dim   width of one head; equals sum(axes_dims_rope)
#   joint_attention_dim  width of the text embeddings, equal to the text encoder's hidden_size
#   axes_dims_rope       RoPE widths for (frame, row, column); each even
QWEN_TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
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

# AutoencoderKLQwenImage; the same keys as AutoencoderKLWan's (see VAE_CONFIGS). Latent statistics are
# drawn from the seed, as for Wan.
QWEN_VAE_CONFIGS: dict[str, dict[str, Any]] = {
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
QWEN_TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
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

# The locally trained byte-level BPE (Qwen2 tokenizer). Same keys as TOKENIZER_CONFIGS.
QWEN_TOKENIZER_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=2000, corpus_sentences=6000, corpus_names=2000),
    "small": dict(vocab_size=8000, corpus_sentences=12000, corpus_names=12000),
}

# Qwen2.5's special tokens: the chat template's markers (which QwenImagePipeline's prompt template uses) and
# the vision markers the text encoder's config names. <|endoftext|> is the pad and end-of-text token.
QWEN_SPECIAL_TOKENS = (
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
QWEN_PROMPT_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
QWEN_PROMPT_DROP_TOKENS = 34

# FlowMatchEulerDiscreteScheduler configured as in the published Qwen-Image checkpoint: the shift `mu` is
# computed per request from the image's sequence length (dynamic shifting, exponential time shift) and
# the sigmas are stretched to end at shift_terminal.
QWEN_SCHEDULER_CONFIG: dict[str, Any] = dict(
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

# The request each Qwen-Image preset is sized for (QwenImagePipeline keyword arguments; guidance_scale is
# its true_cfg_scale). One image: num_frames is always 1.
QWEN_DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=4.0),
    "small": dict(height=256, width=256, num_frames=1, num_inference_steps=8, guidance_scale=4.0),
}

# model_index.json entries as in the published Qwen-Image checkpoint.
_QWEN_COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "transformer": ("diffusers", "QwenImageTransformer2DModel"),
    "vae": ("diffusers", "AutoencoderKLQwenImage"),
}


def init_model(
    family: str,
    preset: str,
    out_dir: str | Path,
    seed: int = 0,
    shard_size: int | None = None,
) -> Path:
    """Write a random-weight `family` checkpoint of size `preset` to `out_dir` and return its path.

    The same seed gives byte-identical weight files. `shard_size` (bytes) splits large weight files
    into shards, as big real checkpoints are.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; allowed: {', '.join(FAMILIES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {} if shard_size is None else {"max_shard_size": shard_size}
    logger.info("writing %s/%s checkpoint (seed %d) to %s", family, preset, seed, out)

    # Seeding stays local to this call; weights are created (and so saved) in float32.
    with torch.random.fork_rng(devices=[]), _default_dtype(torch.float32):
        if family == "qwen-image":
            _write_qwen_image_components(out, preset, seed, save_kwargs)
        else:
            _write_wan_components(out, preset, seed, save_kwargs, two_experts=family == "wan2.2-a14b")

    if family == "qwen-image":
        _write_qwen_image_model_index(out)
    else:
        _write_model_index(out, two_experts=family == "wan2.2-a14b")
    _write_default_request(out, family, preset)
    logger.info("checkpoint written to %s", out)
    return out


def _write_wan_components(out: Path, preset: str, seed: int, save_kwargs: dict[str, Any], two_experts: bool) -> None:
    """Tokenizer, UMT5 text encoder, transformer(s), VAE and scheduler of a Wan checkpoint."""
    tokenizer = build_tokenizer(**TOKENIZER_CONFIGS[preset])
    tokenizer.save_pretrained(out / "tokenizer")
    logger.info("tokenizer: %d tokens", len(tokenizer))

    torch.manual_seed(seed)
    text_encoder = build_text_encoder(preset, vocab_size=len(tokenizer))
    text_encoder.save_pretrained(out / "text_encoder", **save_kwargs)
    logger.info("text_encoder: %.2fM parameters", _millions(text_encoder))
    del text_encoder

    torch.manual_seed(seed)
    transformer = build_transformer(preset)
    transformer.save_pretrained(out / "transformer", **save_kwargs)
    logger.info("transformer: %.2fM parameters", _millions(transformer))
    del transformer

    if two_experts:
        # The low-noise expert gets its own seed, so the two experts differ and a switch at the wrong
        # step shows in the output.
        torch.manual_seed(seed + SECOND_EXPERT_SEED_OFFSET)
        transformer_2 = build_transformer(preset)
        transformer_2.save_pretrained(out / "transformer_2", **save_kwargs)
        logger.info("transformer_2: %.2fM parameters", _millions(transformer_2))
        del transformer_2

    torch.manual_seed(seed)
    vae = build_vae(preset, seed)
    vae.save_pretrained(out / "vae", **save_kwargs)
    logger.info("vae: %.2fM parameters", _millions(vae))
    del vae

    build_scheduler().save_pretrained(out / "scheduler")


def _write_qwen_image_components(out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Tokenizer, Qwen2.5-VL text encoder, transformer, VAE and scheduler of a Qwen-Image checkpoint."""
    tokenizer = build_qwen_tokenizer(**QWEN_TOKENIZER_CONFIGS[preset])
    tokenizer.save_pretrained(out / "tokenizer")
    logger.info("tokenizer: %d tokens", len(tokenizer))

    torch.manual_seed(seed)
    text_encoder = build_qwen_text_encoder(preset, tokenizer)
    text_encoder.save_pretrained(out / "text_encoder", **save_kwargs)
    logger.info("text_encoder: %.2fM parameters", _millions(text_encoder))
    del text_encoder

    torch.manual_seed(seed)
    transformer = build_qwen_transformer(preset)
    transformer.save_pretrained(out / "transformer", **save_kwargs)
    logger.info("transformer: %.2fM parameters", _millions(transformer))
    del transformer

    torch.manual_seed(seed)
    vae = build_qwen_vae(preset, seed)
    vae.save_pretrained(out / "vae", **save_kwargs)
    logger.info("vae: %.2fM parameters", _millions(vae))
    del vae

    build_qwen_scheduler().save_pretrained(out / "scheduler")


def build_transformer(preset: str) -> torch.nn.Module:
    """The preset's WanTransformer3DModel with freshly initialised weights."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**TRANSFORMER_CONFIGS[preset]).eval()


def build_vae(preset: str, seed: int) -> torch.nn.Module:
    """The preset's AutoencoderKLWan, with latent statistics drawn from `seed`."""
    from diffusers import AutoencoderKLWan

    config = dict(VAE_CONFIGS[preset])
    mean, std = _latent_statistics(config["z_dim"], seed)
    config["latents_mean"], config["latents_std"] = mean, std
    return AutoencoderKLWan(**config).eval()


def build_text_encoder(preset: str, vocab_size: int) -> torch.nn.Module:
    """The preset's UMT5EncoderModel, with one embedding row per tokenizer token."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=vocab_size, **TEXT_ENCODER_CONFIGS[preset])
    return UMT5EncoderModel(config).eval()


def build_scheduler() -> Any:
    """The flow-matching UniPC scheduler Wan2.1 ships with."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**SCHEDULER_CONFIG)


def build_tokenizer(vocab_size: int, corpus_sentences: int, corpus_names: int) -> Any:
    """A T5-style (sentencepiece Unigram) tokenizer trained on the built-in corpus.

    Like UMT5's: <pad>=0, </s>=1, <unk>=2; NFKC normalisation with runs of whitespace collapsed;
    Metaspace pre-tokenisation ("▁" marks a word start); "</s>" appended to every sequence.
    It depends only on its arguments, not on any seed: a preset always gets the same tokenizer.
    """
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        unk_token="<unk>",
        # Every printable ASCII character gets a piece, so plain English text never maps to <unk>.
        initial_alphabet=[c for c in string.printable if not c.isspace()],
        max_piece_length=16,
        show_progress=False,
    )
    trained = _with_t5_pipeline(Tokenizer(models.Unigram()))
    trained.train_from_iterator(training_corpus(corpus_sentences, corpus_names), trainer=trainer)
    vocab = _canonical_vocab(json.loads(trained.to_str())["model"]["vocab"])

    unk_id = SPECIAL_TOKENS.index("<unk>")
    tokenizer = _with_t5_pipeline(Tokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=False)))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    # In transformers 5 PreTrainedTokenizerFast is TokenizersBackend, the name saved and resolved.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=1_000_000,  # effectively unlimited, as UMT5's: the pipeline truncates itself
        padding_side="right",
    )


def build_qwen_transformer(preset: str) -> torch.nn.Module:
    """The preset's QwenImageTransformer2DModel with freshly initialised weights."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(**QWEN_TRANSFORMER_CONFIGS[preset]).eval()


def build_qwen_vae(preset: str, seed: int) -> torch.nn.Module:
    """The preset's AutoencoderKLQwenImage, with latent statistics drawn from `seed`."""
    from diffusers import AutoencoderKLQwenImage

    config = dict(QWEN_VAE_CONFIGS[preset])
    mean, std = _latent_statistics(config["z_dim"], seed)
    config["latents_mean"], config["latents_std"] = mean, std
    return AutoencoderKLQwenImage(**config).eval()


def build_qwen_text_encoder(preset: str, tokenizer: Any) -> torch.nn.Module:
    """The preset's Qwen2_5_VLForConditionalGeneration, its token ids matching `tokenizer`."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    sizes = QWEN_TEXT_ENCODER_CONFIGS[preset]
    text = dict(sizes["text"])
    mrope_section = text.pop("mrope_section")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
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


def build_qwen_scheduler() -> Any:
    """The dynamically shifted flow-matching Euler scheduler Qwen-Image ships with."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER_CONFIG)


def build_qwen_tokenizer(vocab_size: int, corpus_sentences: int, corpus_names: int) -> Any:
    """A Qwen2-style byte-level BPE tokenizer trained on the built-in corpus, saved as Qwen2Tokenizer.

    The normaliser (NFC), pre-tokeniser (Qwen2's split regex, then byte-level) and decoder are exactly
    what `Qwen2Tokenizer` builds around a vocabulary and merges, so the class reloads it unchanged. The
    corpus includes QwenImagePipeline's prompt template, so the template prefix tokenizes to the
    QWEN_PROMPT_DROP_TOKENS tokens the pipeline drops (checked here).
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
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = training_corpus(corpus_sentences, corpus_names)
    # The template as the pipeline fills it, repeated so its words become single tokens.
    template = QWEN_PROMPT_TEMPLATE_PREFIX + "{}<|im_end|>\n<|im_start|>assistant\n"
    corpus += [template.format(line) for line in corpus[:200]] * 5
    trained.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        model_max_length=131072,
    )
    prefix_ids = tokenizer(QWEN_PROMPT_TEMPLATE_PREFIX)["input_ids"]
    if len(prefix_ids) != QWEN_PROMPT_DROP_TOKENS:
        pieces = tokenizer.convert_ids_to_tokens(prefix_ids)
        raise RuntimeError(
            f"the prompt template prefix tokenized to {len(prefix_ids)} tokens, not {QWEN_PROMPT_DROP_TOKENS}: {pieces}"
        )
    return tokenizer


def _latent_statistics(z_dim: int, seed: int) -> tuple[list[float], list[float]]:
    """Per-channel latent mean and std (positive, in [1, 3) like the real models') drawn from `seed`."""
    stats = torch.Generator().manual_seed(seed)
    mean = torch.randn(z_dim, generator=stats, device="cpu") * 0.5
    std = 1.0 + 2.0 * torch.rand(z_dim, generator=stats, device="cpu")
    return [round(v, 4) for v in mean.tolist()], [round(v, 4) for v in std.tolist()]


def _with_t5_pipeline(tokenizer: Any) -> Any:
    """Attach T5's normaliser, pre-tokeniser, decoder and "$A </s>" post-processor to `tokenizer`."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    eos_id = SPECIAL_TOKENS.index("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)]
    )
    return tokenizer


def _canonical_vocab(vocab: list[list[Any]]) -> list[tuple[str, float]]:
    """The trained Unigram vocabulary in a run-independent order.

    The trainer gives characters that never won a segmentation a score just above the lowest one,
    0.0001 apart in hash-set order, which differs from run to run. Give them all the lowest score,
    round away summation noise, and break ties by the piece itself.
    """
    specials = [(str(piece), 0.0) for piece, _ in vocab[: len(SPECIAL_TOKENS)]]
    if [piece for piece, _ in specials] != list(SPECIAL_TOKENS):
        raise RuntimeError(f"special tokens came out as {specials}, expected {SPECIAL_TOKENS} first")
    learned = [(str(piece), float(score)) for piece, score in vocab[len(SPECIAL_TOKENS) :]]
    lowest = min(score for _, score in learned)
    band = lowest + 1e-4 * (sum(len(piece) == 1 for piece, _ in learned) + 1)
    learned = [(piece, lowest if len(piece) == 1 and score <= band else score) for piece, score in learned]
    learned = sorted(((piece, round(score, 6)) for piece, score in learned), key=lambda ps: (-ps[1], ps[0]))
    return specials + learned


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _write_default_request(out: Path, family: str, preset: str) -> None:
    """Records the request the preset is sized for; servers use it for fields a request leaves unset.

    Real checkpoints have no such file and get their family's reference defaults (services/checkpoint.py).
    """
    if family == "qwen-image":
        default_request = {**QWEN_DEFAULT_REQUESTS[preset], "fps": DEFAULT_FPS}
    else:
        default_request = {**DEFAULT_REQUESTS[preset], "fps": DEFAULT_FPS}
    (out / DEFAULTS_FILE).write_text(json.dumps({"default_request": default_request}, indent=2) + "\n")


def _write_model_index(out: Path, two_experts: bool = False) -> None:
    """model_index.json as in the published Wan2.1 (or, with two experts, Wan2.2-T2V-A14B) diffusers checkpoints.

    WanPipeline registers `boundary_ratio` and `expand_timesteps` as pipeline config entries, so they sit
    next to the components in model_index.json; the A14B checkpoint adds the `transformer_2` component.
    """
    import diffusers

    index: dict[str, Any] = {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__}
    index.update({name: list(cls) for name, cls in _COMPONENT_CLASSES.items()})
    if two_experts:
        index["transformer_2"] = list(_COMPONENT_CLASSES["transformer"])
        index["boundary_ratio"] = A14B_BOUNDARY_RATIO
        index["expand_timesteps"] = False
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_qwen_image_model_index(out: Path) -> None:
    """model_index.json as in the published Qwen-Image diffusers checkpoint."""
    import diffusers

    index: dict[str, Any] = {"_class_name": "QwenImagePipeline", "_diffusers_version": diffusers.__version__}
    index.update({name: list(cls) for name, cls in _QWEN_COMPONENT_CLASSES.items()})
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _millions(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


# ---------------------------------------------------------------------------------------------
# Tokenizer training corpus: a few paragraphs of varied prose plus video-prompt-like sentences
# generated deterministically from word lists, enough distinct words and sub-words for an
# 8000-piece vocabulary.


def _words(text: str) -> list[str]:
    return text.split()


def _phrases(text: str) -> list[str]:
    return [phrase.strip() for phrase in text.split("|")]


_PROSE = """
A red fox trots across a snowy field at dawn, its breath rising in small white clouds. The camera
follows from a low angle, then slowly pulls back to reveal a frozen lake and a line of dark pine
trees. In the distance a church bell rings twice; crows lift from the branches and scatter.

The city never sleeps. Neon signs flicker above wet streets, taxis splash through puddles, and a
street vendor fans the smoke rising from his grill. A woman in a yellow raincoat waits under an
umbrella while trams glide past, their windows glowing with warm light. It is 11:45 p.m. on a
Thursday in November, and the forecast promises 3 to 5 centimetres of rain before midnight.

Under the ocean surface, sunlight breaks into shifting ribbons. A sea turtle drifts over a coral
reef where clownfish dart between anemones; a shoal of silver sardines turns all at once, like a
single living mirror. Bubbles climb toward the light, wobbling as they go.

Close-up of an old craftsman's hands shaping wet clay on a potter's wheel. The bowl grows taller
and thinner with every turn. Dust hangs in the afternoon light; on the shelves behind him stand
dozens of jars, vases and cups, glazed blue, green, ochre and deep crimson.

An astronaut floats inside the space station, tapping a tablet as Earth rolls past the window:
deserts, oceans, the thin blue edge of the atmosphere, and then the sudden darkness of night with
cities glittering like embers. "Houston, we're ready for the next experiment," she says.

Time-lapse: clouds race over a mountain valley, shadows sweep across green meadows, and a river
winds toward the horizon. Wildflowers open and close; the sun sets behind jagged peaks, stars wheel
overhead, and the Milky Way slowly rises above a quiet campsite with one glowing orange tent.

Professional product shot of a glass perfume bottle on black marble, soft rim lighting, shallow
depth of field, 4K, 60 fps, highly detailed, photorealistic. Negative: blurry, low quality,
overexposed, watermark, text, distorted hands, extra fingers, jpeg artifacts, static, worst quality.

Children chase soap bubbles through a sunny park while a golden retriever bounds after them,
barking happily. An elderly couple shares a bench and a thermos of tea; pigeons gather at their feet
hoping for crumbs. Somewhere a violinist plays a slow waltz, and the leaves begin to fall.
"""

_SUBJECTS = _words("""
fox wolf bear deer rabbit squirrel owl eagle hawk sparrow pigeon swan duck goose heron flamingo
penguin dolphin whale shark octopus jellyfish turtle crab lobster salmon butterfly dragonfly bee
ant spider horse pony donkey cow sheep goat pig chicken rooster cat kitten dog puppy lion tiger
leopard cheetah panther elephant giraffe zebra hippo rhino gorilla monkey chimpanzee panda koala
kangaroo camel llama alpaca otter beaver raccoon hedgehog badger lizard chameleon snake crocodile
frog toad dragon unicorn phoenix robot android astronaut pilot sailor fisherman farmer gardener
baker chef waiter painter sculptor dancer ballerina drummer guitarist pianist violinist singer
child toddler teenager grandmother grandfather woman man girl boy knight samurai ninja wizard witch
pirate cowboy detective soldier firefighter doctor nurse scientist engineer student teacher monk
skateboarder surfer skier snowboarder cyclist runner swimmer climber diver juggler magician clown
train tram bus taxi truck tractor motorcycle bicycle scooter sailboat yacht canoe kayak submarine
airplane helicopter balloon rocket spaceship satellite drone lighthouse windmill castle cathedral
""")

_ADJECTIVES = _words("""
red orange yellow green blue purple violet pink crimson scarlet golden silver bronze copper white
black grey brown turquoise emerald sapphire amber ivory pale dark bright vivid glowing shimmering
sparkling glittering gleaming dusty rusty muddy snowy icy frozen foggy misty rainy stormy windy
sunny cloudy humid tropical arctic ancient old young tiny small little huge giant enormous massive
tall short thin fat slender fluffy furry feathery scaly wet dry soft hard smooth rough sharp blunt
wooden metallic glass crystal plastic paper velvet silk leather woolen cotton marble stone brick
happy sad angry calm curious playful sleepy lazy energetic graceful clumsy elegant mysterious
magical futuristic retro vintage modern medieval baroque gothic minimalist surreal whimsical
cinematic dramatic moody serene peaceful chaotic busy quiet lonely crowded abandoned haunted
""")

_VERBS = _words("""
runs walks jumps leaps hops climbs crawls swims dives flies soars glides floats drifts spins
twirls dances sings plays paints draws writes reads sleeps dreams wakes eats drinks cooks bakes
laughs smiles cries shouts whispers waves nods bows kneels sits stands rests waits watches looks
searches explores wanders travels rides drives sails rows paddles surfs skates skis races chases
hunts catches throws kicks pushes pulls lifts carries holds drops builds repairs opens closes
""")

_PLACES = _words("""
forest jungle desert savanna meadow prairie field farm orchard vineyard garden park playground
beach shore coast cliff cave canyon valley mountain volcano glacier island lagoon lake pond river
stream waterfall ocean sea reef harbor port dock pier bridge tunnel road highway street alley
market bazaar square plaza fountain temple shrine palace tower skyscraper rooftop balcony attic
basement kitchen bedroom library classroom laboratory factory warehouse workshop studio theater
stadium arena museum gallery station airport subway village town city metropolis spaceport moon
planet nebula galaxy asteroid orbit wasteland swamp marsh tundra steppe oasis dune hillside
""")

_TIMES = _phrases("""
at dawn|at sunrise|in the morning|at noon|in the afternoon|at sunset|at dusk|at twilight|at night|
at midnight|during a thunderstorm|in heavy rain|in light snow|in thick fog|under a full moon|
under the stars|in early spring|in late summer|in autumn|in the depths of winter|during a festival|
on a quiet Sunday|in the year 2077|in the nineteenth century|during the golden hour
""")

_STYLES = _phrases("""
cinematic lighting|soft natural light|dramatic shadows|volumetric fog|lens flare|shallow depth of field|
wide angle|close-up shot|aerial view|drone footage|tracking shot|slow motion|time-lapse|handheld camera|
the camera pans left|the camera pans right|the camera tilts up|the camera zooms in|the camera orbits|
photorealistic|hyperrealistic|oil painting|watercolor|pencil sketch|anime style|pixel art|claymation|
stop motion|film grain|35mm film|black and white|high contrast|pastel colors|neon colors|
ultra detailed|8K resolution|HDR|studio lighting|documentary style|dreamlike atmosphere
""")

_PREPOSITIONS = _words("across through over under along beside behind inside around toward near into past above")


# Syllable parts for made-up names of people and places ("Brisca", "Talvoren").
# An empty onset or coda lets a syllable start with its vowel or end on it.
_ONSETS = _words("b bl br c ch cl cr d dr f fl fr g gl gr h j k l m n p pl pr qu r s sc sh sk sl sn st sw t th tr")
_ONSETS += ["v", "w", "z", ""]
_NUCLEI = _words("a e i o u y ai au ea ee ei ie oa oo ou")
_CODAS = _words("n r l s m th nd rk st x ck ll ng rn ld nt sh") + [""] * 6


def _made_up_names(rng: random.Random, count: int) -> list[str]:
    """`count` distinct pronounceable names, two or three syllables each."""
    names: set[str] = set()
    while len(names) < count:
        syllables = rng.choice((2, 2, 3))
        name = ""
        for i in range(syllables):
            name += rng.choice(_ONSETS) + rng.choice(_NUCLEI)
            if i == syllables - 1 or rng.random() < 0.3:
                name += rng.choice(_CODAS)
        names.add(name.capitalize())
    return sorted(names)


def training_corpus(num_sentences: int, num_names: int) -> list[str]:
    """The tokenizer's training text: the prose above plus `num_sentences` generated prompts."""
    rng = random.Random(20240229)
    names = _made_up_names(rng, num_names)
    lines = [line.strip() for line in _PROSE.strip().splitlines() if line.strip()]
    for _ in range(num_sentences):
        subject = f"{rng.choice(_ADJECTIVES)} {rng.choice(_SUBJECTS)}"
        if rng.random() < 0.5:
            subject += f" named {rng.choice(names)}"
        place = f"{rng.choice(_ADJECTIVES)} {rng.choice(_PLACES)} of {rng.choice(names)}"
        article = rng.choice(["A", "The", "One", "A single"])
        if article == "A" and subject[0] in "aeiou":
            article = "An"
        sentence = f"{article} {subject} {rng.choice(_VERBS)} "
        sentence += f"{rng.choice(_PREPOSITIONS)} the {place} {rng.choice(_TIMES)}"
        sentence += f", {rng.choice(_STYLES)}, {rng.choice(_STYLES)}"
        if rng.random() < 0.3:
            sentence += f", {rng.randint(2, 120)} frames at {rng.choice([8, 16, 24, 30, 60])} fps"
        lines.append(sentence + rng.choice([".", ".", "!", "?", ";"]))
    return lines
