"""The "z-image-turbo-config" preset: Z-Image-Turbo's published configs with random bf16 weights (families/real_size.py
writes them): the 6B single-stream transformer (ZImageTransformer2DModel's defaults are the published config),
Qwen3-4B as the text encoder and FLUX.1's AutoencoderKL, about 20 GB on disk. The tokenizer is the "small"
preset's, trained here; the embedding table keeps its published rows. No defaults file: like a downloaded
checkpoint, it gets Turbo's defaults from its scheduler (checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from families.base import Family
from families.flux.real_size import REAL_VAE_CONFIG
from families.init_model import save_tokenizer, write_model_index
from families.qwen_image.init_model import SPECIAL_TOKENS
from families.real_size import Builders, save_real_size_components
from families.z_image.init_model import COMPONENT_CLASSES, build_chat_tokenizer, build_scheduler

# text_encoder/config.json: Qwen3-4B (36 layers of 2560, 32 query and 8 key/value heads of 128).
REAL_QWEN3_4B_CONFIG: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True,
)


def qwen3_4b_config(tokenizer: Any | None) -> Any:
    """Qwen3-4B's config with the special token ids of `tokenizer` (the locally trained one; None: 0 for each,
    which changes no size)."""
    from transformers import Qwen3Config

    ids = {token: 0 if tokenizer is None else tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    return Qwen3Config(
        **REAL_QWEN3_4B_CONFIG,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def real_size_builders(preset: str, tokenizer: Any | None = None) -> Builders:
    """The preset's weighted components, each a function building it (on the meta device, by the caller)."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Model

    return {
        "text_encoder": lambda: Qwen3Model(qwen3_4b_config(tokenizer)),
        "transformer": lambda: ZImageTransformer2DModel(),
        "vae": lambda: AutoencoderKL(**REAL_VAE_CONFIG),
    }


def write_real_size_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    tokenizer = build_chat_tokenizer("small")
    save_tokenizer(tokenizer, out)
    save_real_size_components(out, real_size_builders(preset, tokenizer), seed, save_kwargs)
    build_scheduler("turbo").save_pretrained(out / "scheduler")
    write_model_index(out, family, COMPONENT_CLASSES)
