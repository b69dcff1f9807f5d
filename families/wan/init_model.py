"""Random-weight Wan checkpoints in the published diffusers layout (`stagediff init-model --family wan-t2v`).

  wan-t2v       Wan2.1 text-to-video: one WanTransformer3DModel
  wan2.2-a14b   Wan2.2-T2V-A14B: two WanTransformer3DModel experts (`transformer` for high noise,
                `transformer_2` for low noise) and the pipeline config entry `boundary_ratio`

Both are written by `write_checkpoint`, which reads the difference from the Family it is given: a family
that requires the `transformer_2` component gets the second expert, and one that requires the
`boundary_ratio` config entry gets that entry. The preset tables (presets.py) size every component, built
by components.py.

wan-t2v also declares the preset "wan2.1-1.3b-config" (`Family.own_presets`): the published
Wan2.1-T2V-1.3B-Diffusers configs and shard layout with random bf16 weights, written by real_size.py; given
`config_from` (`stagediff init-model --config-from DIR|ORG/NAME`), another checkpoint's configs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.init_model import save_component, save_tokenizer, write_default_request, write_model_index
from families.wan.components import build_scheduler, build_text_encoder, build_tokenizer, build_transformer, build_vae
from families.wan.presets import (
    A14B_BOUNDARY_RATIO,
    COMPONENT_CLASSES,
    DEFAULT_REQUESTS,
    SECOND_EXPERT_SEED_OFFSET,
    TOKENIZER_CONFIGS,
)
from families.wan.real_size import REAL_SIZE_PRESET, write_real_size_checkpoint


def write_checkpoint(
    family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any], config_from: Path | None = None
) -> None:
    """Tokenizer, UMT5 text encoder, transformer(s), VAE, scheduler, model_index.json and defaults file.

    model_index.json is as in the published Wan2.1 (or, with two experts, Wan2.2-T2V-A14B) diffusers
    checkpoints. WanPipeline registers `boundary_ratio` and `expand_timesteps` as pipeline config entries,
    so they sit next to the components in model_index.json.
    """
    if preset == REAL_SIZE_PRESET:
        write_real_size_checkpoint(family, out, seed, save_kwargs, config_from)
        return
    tokenizer = build_tokenizer(**TOKENIZER_CONFIGS[preset])
    save_tokenizer(tokenizer, out)

    torch.manual_seed(seed)
    save_component(build_text_encoder(preset, vocab_size=len(tokenizer)), out, "text_encoder", save_kwargs)

    torch.manual_seed(seed)
    save_component(build_transformer(preset), out, "transformer", save_kwargs)
    components = dict(COMPONENT_CLASSES)
    if "transformer_2" in family.requires:
        # The low-noise expert gets its own seed, so the two experts differ and a switch at the wrong
        # step shows in the output.
        torch.manual_seed(seed + SECOND_EXPERT_SEED_OFFSET)
        save_component(build_transformer(preset), out, "transformer_2", save_kwargs)
        components["transformer_2"] = COMPONENT_CLASSES["transformer"]

    torch.manual_seed(seed)
    save_component(build_vae(preset, seed), out, "vae", save_kwargs)

    build_scheduler().save_pretrained(out / "scheduler")

    entries: dict[str, Any] = {}
    if "boundary_ratio" in family.requires:
        entries.update(boundary_ratio=A14B_BOUNDARY_RATIO, expand_timesteps=False)
    write_model_index(out, family, components, **entries)
    write_default_request(out, family, DEFAULT_REQUESTS[preset])
