"""Fused mode (--lora NAME[:SCALE]): adapters fused into the transformer's weights once at startup, served as
a model of their own ("BASE+NAME[:SCALE]"), at no cost per step."""

from __future__ import annotations

import logging
import math

from torch import nn

from dit_svc.lora.checks import read_adapter
from dit_svc.lora.directory import adapter_path
from dit_svc.lora.settings import LoraSettings, loader_class, peft_name
from services.validation import LORA_NAME

logger = logging.getLogger(__name__)


def parse_fused(values: list[str]) -> tuple[tuple[str, float], ...]:
    """--lora NAME[:SCALE] values as (name, scale); raises ValueError naming the bad value."""
    fused: list[tuple[str, float]] = []
    for value in values:
        name, colon, scale_text = value.partition(":")
        if not LORA_NAME.fullmatch(name):
            raise ValueError(f"--lora {value}: '{name}' is not an adapter name (NAME or TENANT/NAME)")
        try:
            scale = float(scale_text) if colon else 1.0
        except ValueError:
            raise ValueError(f"--lora {value}: the scale '{scale_text}' is not a number") from None
        if not math.isfinite(scale):
            raise ValueError(f"--lora {value}: the scale must be finite")
        if name in (earlier for earlier, _ in fused):
            raise ValueError(f"--lora {name}: named twice")
        fused.append((name, scale))
    return tuple(fused)


def fuse_adapters(transformer: nn.Module, settings: LoraSettings, num_threads: int = 4) -> None:
    """Fuses --lora's adapters into the transformer's weights at their scales, then drops their layers: from
    here on the model is the fused one, at no cost per step (diffusers' fuse_lora, then unload_lora)."""
    if not settings.fused:
        return
    if settings.directory is None:
        raise ValueError("--lora needs --lora-dir, the directory its adapters are in")
    pipeline_class = loader_class(settings.pipeline)
    for name, scale in settings.fused:
        path = adapter_path(settings.directory, name)
        adapter = read_adapter(name, path, pipeline_class, transformer, settings.max_file_bytes, num_threads)
        internal = peft_name(name)
        adapter.load_into(pipeline_class, transformer, internal)
        transformer.set_adapters([internal], [scale])
        transformer.fuse_lora(adapter_names=[internal])
        transformer.unload_lora()  # the layers go; their product stays in the base weights
        logger.info("lora '%s': fused into the transformer at scale %g", name, scale)


def served_model_id(base: str, fused: tuple[tuple[str, float], ...]) -> str:
    """The model id of a checkpoint served with adapters fused in: "BASE+NAME[:SCALE]+..."."""
    if not fused:
        return base
    parts = [name.replace("/", "-") if scale == 1.0 else f"{name.replace('/', '-')}:{scale:g}" for name, scale in fused]
    return "+".join([base, *parts])
