"""The "hunyuanvideo-1.5-480p-config" and "hunyuanvideo-1.5-480p-i2v-config" presets: the published configs of
hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v (and _i2v) with random bf16 weights (families/real_size.py
writes them): the 8.3B transformer, Qwen2.5-VL-7B's 7.07B language model, the Glyph-SDXL ByT5 encoder (0.22B), the
1.26B VAE and, for image-to-video, SigLIP so400m (0.43B); about 33 GB on disk (34 GB with SigLIP). The Qwen
tokenizer is the "small" preset's, trained here, and the ByT5 tokenizer is ByT5Tokenizer's 384 ids without the
glyph checkpoint's color and font tokens; both embedding tables keep their published rows. No defaults file: like
a downloaded checkpoint, it gets the pipeline's defaults (480x848 from the transformer's target size 640, 121
frames, 50 steps) and its guider's scale (checkpoint.py).

Where each value comes from:
- transformer, scheduler and guider: diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py, which wrote the
  published checkpoints. Its TRANSFORMER_CONFIGS["480p_t2v"] (and "480p_i2v", the same but for task_type) is
  REAL_TRANSFORMER_CONFIG below; HunyuanVideo15Transformer3DModel's constructor defaults (diffusers 0.42) equal it
  except task_type, whose default is "i2v". Its SCHEDULER_CONFIGS give shift 5.0 for 480p (t2v and i2v; 9.0 and
  7.0 for 720p) and its GUIDANCE_CONFIGS guidance_scale 6.0 (1.0 for the distilled checkpoints): init_model.py's
  SCHEDULER_SHIFT and GUIDANCE_SCALE. 8.3B is the model card's figure (tencent/HunyuanVideo-1.5 README).
- VAE: the script builds AutoencoderKLHunyuanVideo15() with no arguments and loads the original weights strictly,
  so the constructor's defaults are the published config: 32 latent channels, widths (128, 256, 512, 1024, 1024),
  2 resnets a level, 16x spatial and 4x temporal compression, scaling_factor 1.03682.
- text_encoder: the script saves Qwen/Qwen2.5-VL-7B-Instruct's language_model; its text config (as quoted in
  kohya-ss/sd-scripts library/hunyuan_image_text_encoder.py, which pins the same checkpoint): hidden 3584, 28 layers,
  28 query and 4 key/value heads, intermediate 18944, vocabulary 152064, rope theta 1e6, mrope_section [16, 24, 24],
  max positions 128000, RMS-norm eps 1e-6.
- text_encoder_2: the script loads google/byt5-small as a T5EncoderModel (d_model 1472, d_ff 3584, d_kv 64, 6
  heads, 12 layers, gated GELU), adds Glyph-SDXL-v2's color and font tokens to its tokenizer and resizes the
  embedding to the tokenizer's length: 384 + 138 colors (assets/color_idx.json) + 988 fonts
  (assets/multilingual_10-lang_idx.json), both as copied into sd-scripts' module above, gives 1510 rows. A
  Tenstorrent port of this encoder (tt-metal, models/tt_dit) checks vocab_size 1510 against the published
  text_encoder_2/config.json.
- image_encoder (image-to-video): HunyuanVideo 1.5's checkpoints-download.md takes SigLIP from
  black-forest-labs/FLUX.1-Redux-dev, google/siglip-so400m-patch14-384's vision tower: hidden 1152, intermediate
  4304, 27 layers, 16 heads, 384x384 images in patches of 14 (729 tokens); its processor resizes to 384x384.

Not confirmed: whether the published image_encoder carries SigLIP's attention-pooling head (16M parameters;
SiglipVisionModel builds it by default and the pipeline reads the last hidden state, not the pooled output): it is
built here. The Qwen config is a third party's quote of Qwen's, not Qwen's file itself; the published ByT5
config is known through the Tenstorrent port's check and the asset counts, not read directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from families.base import Family
from families.hunyuanvideo_15.init_model import (
    COMPONENT_CLASSES,
    IMAGE_COMPONENT_CLASSES,
    build_chat_tokenizer,
    save_scheduler_and_guider,
)
from families.init_model import save_tokenizer, write_model_index
from families.qwen_image.init_model import SPECIAL_TOKENS
from families.real_size import Builders, save_real_size_components

T2V_PRESET = "hunyuanvideo-1.5-480p-config"
I2V_PRESET = "hunyuanvideo-1.5-480p-i2v-config"

# transformer/config.json: 54 dual-stream blocks of 16 heads of 128, the text refiner's 2 blocks, 65 input channels
# (32 latent, 32 condition latent, 1 mask), target size 640 (480p). task_type is the preset's.
REAL_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    in_channels=65,
    out_channels=32,
    num_attention_heads=16,
    attention_head_dim=128,
    num_layers=54,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=1,
    patch_size_t=1,
    qk_norm="rms_norm",
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    image_embed_dim=1152,
    rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
    use_meanflow=False,
    target_size=640,
)
# text_encoder/config.json: Qwen2.5-VL-7B-Instruct's language model.
REAL_QWEN25_VL_7B_CONFIG: dict[str, Any] = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
# text_encoder_2/config.json: byt5-small's encoder with Glyph-SDXL-v2's 1126 color and font tokens added.
REAL_BYT5_CONFIG: dict[str, Any] = dict(
    vocab_size=1510,
    d_model=1472,
    d_ff=3584,
    d_kv=64,
    num_layers=12,
    num_heads=6,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
    tie_word_embeddings=False,
    use_cache=False,
)
# image_encoder/config.json: SigLIP so400m-patch14-384's vision tower; the processor's square side.
REAL_SIGLIP_CONFIG: dict[str, Any] = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    image_size=384,
    patch_size=14,
    layer_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
)


def qwen25_vl_7b_config(tokenizer: Any | None) -> Any:
    """Qwen2.5-VL-7B's text config with the special token ids of `tokenizer` (the locally trained one; None: 0
    for each, which changes no size)."""
    from transformers import Qwen2_5_VLTextConfig

    ids = {token: 0 if tokenizer is None else tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    return Qwen2_5_VLTextConfig(
        **REAL_QWEN25_VL_7B_CONFIG,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def real_size_builders(preset: str, tokenizer: Any | None = None) -> Builders:
    """The preset's weighted components, each a function building it (on the meta device, by the caller)."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel
    from transformers import (
        Qwen2_5_VLTextModel,
        SiglipVisionConfig,
        SiglipVisionModel,
        T5Config,
        T5EncoderModel,
    )

    if preset not in (T2V_PRESET, I2V_PRESET):
        raise ValueError(f"{preset!r} is not a HunyuanVideo 1.5 real-size preset ({T2V_PRESET}, {I2V_PRESET})")
    image_to_video = preset == I2V_PRESET
    builders: Builders = {
        "text_encoder": lambda: Qwen2_5_VLTextModel(qwen25_vl_7b_config(tokenizer)),
        "text_encoder_2": lambda: T5EncoderModel(T5Config(**REAL_BYT5_CONFIG)),
        "transformer": lambda: HunyuanVideo15Transformer3DModel(
            **REAL_TRANSFORMER_CONFIG, task_type="i2v" if image_to_video else "t2v"
        ),
        "vae": lambda: AutoencoderKLHunyuanVideo15(),
    }
    if image_to_video:
        builders["image_encoder"] = lambda: SiglipVisionModel(SiglipVisionConfig(**REAL_SIGLIP_CONFIG))
    return builders


def write_real_size_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Both tokenizers, every weighted component, scheduler, guider and model_index.json (the image processor too
    for image-to-video)."""
    from transformers import ByT5Tokenizer, SiglipImageProcessor

    tokenizer = build_chat_tokenizer("small")
    save_tokenizer(tokenizer, out)
    ByT5Tokenizer().save_pretrained(out / "tokenizer_2")
    save_real_size_components(out, real_size_builders(preset, tokenizer), seed, save_kwargs)
    save_scheduler_and_guider(out)
    components = dict(COMPONENT_CLASSES)
    if preset == I2V_PRESET:
        side = REAL_SIGLIP_CONFIG["image_size"]
        SiglipImageProcessor(size={"height": side, "width": side}).save_pretrained(out / "feature_extractor")
        components.update(IMAGE_COMPONENT_CLASSES)
    write_model_index(out, family, components)
