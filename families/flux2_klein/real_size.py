"""The "flux2-klein-4b-config" preset: FLUX.2 [klein] 4B's published configs with random bf16 weights
(families/real_size.py writes them): the 4B transformer (5 double-stream and 20 single-stream blocks of 24 heads
of 128, text width 3 x 2560), Qwen3-4B as the text encoder and FLUX.2's 32-channel AutoencoderKLFlux2, about 16 GB
on disk. The tokenizer is the "small" preset's, trained here; the embedding table keeps its published rows.
model_index.json says `is_distilled: true`, so it gets the distilled kind's defaults (checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from families.base import Family
from families.flux2_klein.init_model import COMPONENT_CLASSES, build_chat_tokenizer, build_scheduler
from families.init_model import save_tokenizer, write_model_index
from families.real_size import Builders, save_real_size_components
from families.z_image.real_size import qwen3_4b_config

# transformer/config.json of FLUX.2-klein-4B.
REAL_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    patch_size=1,
    in_channels=128,
    num_layers=5,
    num_single_layers=20,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=7680,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)


def real_size_builders(preset: str, tokenizer: Any | None = None) -> Builders:
    """The preset's weighted components, each a function building it (on the meta device, by the caller)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    return {
        "text_encoder": lambda: Qwen3ForCausalLM(qwen3_4b_config(tokenizer)),
        "transformer": lambda: Flux2Transformer2DModel(**REAL_TRANSFORMER_CONFIG),
        # AutoencoderKLFlux2's defaults are the published VAE's.
        "vae": lambda: AutoencoderKLFlux2(),
    }


def write_real_size_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    tokenizer = build_chat_tokenizer("small")
    save_tokenizer(tokenizer, out)
    save_real_size_components(out, real_size_builders(preset, tokenizer), seed, save_kwargs)
    build_scheduler().save_pretrained(out / "scheduler")
    write_model_index(out, family, COMPONENT_CLASSES, is_distilled=True)
