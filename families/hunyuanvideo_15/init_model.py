"""Random-weight HunyuanVideo 1.5 checkpoints in the published diffusers layout (`--family hunyuanvideo-1.5`,
`--family hunyuanvideo-1.5-i2v`).

HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15, a Qwen2.5-VL language model (Qwen2_5_VLTextModel)
with a locally trained byte-level BPE tokenizer carrying a Qwen2.5 chat template, a ByT5 encoder
(T5EncoderModel over bytes) with its byte tokenizer, the flow-matching scheduler and the CFG guider, written by
`write_checkpoint`; image-to-video adds a SigLIP vision encoder and its image processor. The preset tables below
size every component of "tiny" and "small"; the real-size presets (`*-config`, the published 480p configs with
random bf16 weights) are real_size.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.hunyuanvideo_15.encode import CROP_START, SYSTEM_MESSAGE
from families.init_model import save_component, save_tokenizer, write_default_request, write_model_index
from families.qwen_image.init_model import SPECIAL_TOKENS, build_tokenizer

# Latent channels of the VAE; the transformer takes twice as many plus one (latents, condition latents, mask).
LATENT_CHANNELS = {"tiny": 8, "small": 16}

# HunyuanVideo15Transformer3DModel. Keys are the model's own config keys.
#   num_layers / num_refiner_layers  dual-stream blocks (54 published) / the text token refiner's (2)
#   num_attention_heads              heads, divisible by 2 and 4 for the layouts tested at 2 and 4 ranks
#   attention_head_dim               width of one head; equals sum(rope_axes_dim)
#   text_embed_dim / text_embed_2_dim  Qwen2.5-VL's hidden size / ByT5's d_model
#   image_embed_dim                  SigLIP's width (image-to-video's image embedding)
#   target_size                      the pixel size the default height and width are chosen around
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        num_attention_heads=4,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        rope_axes_dim=(4, 6, 6),
        text_embed_dim=32,
        text_embed_2_dim=24,
        image_embed_dim=16,
        target_size=64,
    ),
    "small": dict(
        num_attention_heads=8,
        attention_head_dim=32,
        num_layers=6,
        num_refiner_layers=1,
        mlp_ratio=4.0,
        rope_axes_dim=(8, 12, 12),
        text_embed_dim=128,
        text_embed_2_dim=48,
        image_embed_dim=32,
        target_size=256,
    ),
}

# AutoencoderKLHunyuanVideo15: 16x spatial (four upsampling levels, so five widths) and 4x temporal compression as
# published, narrower.
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(block_out_channels=(8, 16, 16, 32, 32), layers_per_block=1),
    "small": dict(block_out_channels=(16, 32, 64, 64, 64), layers_per_block=1),
}

# Qwen2_5_VLTextModel. HunyuanVideo15Pipeline reads the hidden state three from the end, so at least three layers.
TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        mrope_section=[2, 1, 1],
    ),
    "small": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        mrope_section=[4, 6, 6],
    ),
}

# ByT5 (a T5 encoder over UTF-8 bytes, gated-GELU feed-forwards as ByT5's). 384 ids: 3 specials, 256 bytes and
# ByT5Tokenizer's 125 extra ids.
BYT5_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=24, d_ff=48, d_kv=12, num_layers=1, num_heads=2),
    "small": dict(d_model=48, d_ff=96, d_kv=16, num_layers=2, num_heads=3),
}
BYT5_VOCAB = 384

# The locally trained byte-level BPE: (vocab_size, corpus_sentences, corpus_names), families.init_model.training_corpus.
TOKENIZER_CONFIGS: dict[str, tuple[int, int, int]] = {"tiny": (2000, 6000, 2000), "small": (8000, 12000, 12000)}
# Qwen2.5's chat template (what `apply_chat_template` renders for the pipeline's system and user messages): each
# message in <|im_start|>role ... <|im_end|> markers, then the assistant's turn for a generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# The template around the pipeline's system message and one user message, as the tokenizer is trained on it: its
# prefix tokenizes to the 108 tokens the pipeline crops, as with the published tokenizer (checked when built).
TEMPLATE = (
    "<|im_start|>system\n" + SYSTEM_MESSAGE + "<|im_end|>\n<|im_start|>user\n",
    "{}<|im_end|>\n<|im_start|>assistant\n",
    CROP_START,
)

# FlowMatchEulerDiscreteScheduler's fixed shift and the guider's CFG scale as the published 480p checkpoints
# (t2v and i2v) configure them: diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py, SCHEDULER_CONFIGS and
# GUIDANCE_CONFIGS (720p: shift 9.0 for t2v, 7.0 for i2v, scale 6.0; the distilled checkpoints: scale 1.0).
SCHEDULER_SHIFT = 5.0
GUIDANCE_SCALE = 6.0

# SiglipVisionModel (image-to-video's image encoder; its width is the transformer's image_embed_dim) and the square
# its processor resizes to: (image_size / patch_size)^2 tokens (729 published: 384 / 14 rounded down, squared).
IMAGE_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(image_size=56, patch_size=14, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32),
    "small": dict(image_size=112, patch_size=14, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
}

# The request each preset is sized for (HunyuanVideo15Pipeline keyword arguments): 48x80 is 3x5 latents; 9 frames
# are 3 latent frames.
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=48, width=80, num_frames=9, num_inference_steps=2, guidance_scale=GUIDANCE_SCALE),
    "small": dict(height=128, width=224, num_frames=17, num_inference_steps=8, guidance_scale=GUIDANCE_SCALE),
}

# model_index.json entries as in the published HunyuanVideo-1.5 diffusers checkpoints.
COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "guider": ("diffusers", "ClassifierFreeGuidance"),
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Qwen2_5_VLTextModel"),
    "text_encoder_2": ("transformers", "T5EncoderModel"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "tokenizer_2": ("transformers", "ByT5Tokenizer"),
    "transformer": ("diffusers", "HunyuanVideo15Transformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLHunyuanVideo15"),
}


# Image-to-video adds these (HunyuanVideo15ImageToVideoPipeline's model_index.json).
IMAGE_COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "feature_extractor": ("transformers", "SiglipImageProcessor"),
    "image_encoder": ("transformers", "SiglipVisionModel"),
}
I2V_FAMILY = "hunyuanvideo-1.5-i2v"


def write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Both tokenizers and text encoders, transformer, VAE, scheduler, guider, model_index.json and defaults; for
    image-to-video also SigLIP and its image processor. A `*-config` preset is the published configs' (real_size.py).
    """
    if preset.endswith("-config"):
        from families.hunyuanvideo_15.real_size import write_real_size_checkpoint

        write_real_size_checkpoint(family, out, preset, seed, save_kwargs)
        return
    from transformers import ByT5Tokenizer

    tokenizer = build_chat_tokenizer(preset)
    save_tokenizer(tokenizer, out)
    ByT5Tokenizer().save_pretrained(out / "tokenizer_2")

    torch.manual_seed(seed)
    save_component(build_text_encoder(preset, tokenizer), out, "text_encoder", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_byt5(preset), out, "text_encoder_2", save_kwargs)
    image_to_video = family.name == I2V_FAMILY
    torch.manual_seed(seed)
    save_component(build_transformer(preset, image_to_video), out, "transformer", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_vae(preset), out, "vae", save_kwargs)
    save_scheduler_and_guider(out)

    components = dict(COMPONENT_CLASSES)
    if image_to_video:
        torch.manual_seed(seed)
        encoder, processor = build_image_encoder(preset)
        save_component(encoder, out, "image_encoder", save_kwargs)
        processor.save_pretrained(out / "feature_extractor")
        components.update(IMAGE_COMPONENT_CLASSES)
    write_model_index(out, family, components)
    write_default_request(out, family, DEFAULT_REQUESTS[preset])


def save_scheduler_and_guider(out: Path) -> None:
    """The published 480p scheduler (its fixed shift) and CFG guider (its scale) in `out/scheduler`, `out/guider`."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance

    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT).save_pretrained(out / "scheduler")
    ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE).save_pretrained(out / "guider")


def build_chat_tokenizer(preset: str) -> Any:
    """The preset's Qwen2-style tokenizer, trained with the pipeline's templated text, carrying CHAT_TEMPLATE."""
    vocab_size, sentences, names = TOKENIZER_CONFIGS[preset]
    tokenizer = build_tokenizer(vocab_size, sentences, names, templates=(TEMPLATE,))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_transformer(preset: str, image_to_video: bool = False) -> torch.nn.Module:
    """The preset's HunyuanVideo15Transformer3DModel, freshly initialised."""
    from diffusers import HunyuanVideo15Transformer3DModel

    channels = LATENT_CHANNELS[preset]
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * channels + 1,
        out_channels=channels,
        task_type="i2v" if image_to_video else "t2v",
        **TRANSFORMER_CONFIGS[preset],
    ).eval()


def build_image_encoder(preset: str) -> tuple[torch.nn.Module, Any]:
    """The preset's SiglipVisionModel (as wide as the transformer's image embedding) and its image processor."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    sizes = IMAGE_ENCODER_CONFIGS[preset]
    config = SiglipVisionConfig(hidden_size=TRANSFORMER_CONFIGS[preset]["image_embed_dim"], **sizes)
    side = sizes["image_size"]
    processor = SiglipImageProcessor(size={"height": side, "width": side})
    return SiglipVisionModel(config).eval(), processor


def build_vae(preset: str) -> torch.nn.Module:
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15(latent_channels=LATENT_CHANNELS[preset], **VAE_CONFIGS[preset]).eval()


def build_text_encoder(preset: str, tokenizer: Any) -> torch.nn.Module:
    """The preset's Qwen2_5_VLTextModel, its token ids matching `tokenizer`."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    sizes = dict(TEXT_ENCODER_CONFIGS[preset])
    mrope_section = sizes.pop("mrope_section")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **sizes,
    )
    return Qwen2_5_VLTextModel(config).eval()


def build_byt5(preset: str) -> torch.nn.Module:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=BYT5_VOCAB,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        **BYT5_CONFIGS[preset],
    )
    return T5EncoderModel(config).eval()
