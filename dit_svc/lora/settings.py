"""The DiT's adapter options, the error an adapter the stage cannot apply raises, and the name an adapter
takes inside the model."""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from dit_svc.options import DEFAULT_LORA_CACHE_BYTES, DEFAULT_LORA_MAX_FILE_BYTES, DEFAULT_MAX_LORAS_PER_REQUEST
from stagekit.errors import RequestError


class AdapterError(RequestError):
    """An adapter the stage cannot apply; the message names it and what is wrong (the stage keeps serving)."""


@dataclass(frozen=True)
class LoraSettings:
    """The DiT's adapter options (`stagediff serve dit --lora-dir ...`)."""

    directory: Path | None = None
    cache_bytes: int = DEFAULT_LORA_CACHE_BYTES
    max_file_bytes: int = DEFAULT_LORA_MAX_FILE_BYTES
    max_per_request: int = DEFAULT_MAX_LORAS_PER_REQUEST
    # (name, scale) of the adapters fused into the base at startup (--lora NAME[:SCALE]).
    fused: tuple[tuple[str, float], ...] = ()
    # The loader of the family's adapters: a diffusers pipeline's name (Family.pipeline), or the "module:Class"
    # of the family's own loader (Family.lora_loader).
    pipeline: str = ""

    @property
    def per_request(self) -> bool:
        """Requests may name adapters (a directory, and --max-loras-per-request above 0)."""
        return self.directory is not None and self.max_per_request > 0


def loader_class(loader: str) -> type[Any]:
    """The class `LoraSettings.pipeline` names: a "module:Class" path, imported when asked for, or a diffusers
    pipeline."""
    if ":" in loader:
        module, name = loader.split(":")
        return cast(type[Any], getattr(importlib.import_module(module), name))
    import diffusers

    return cast(type[Any], getattr(diffusers, loader))


def loader_name(loader_class: type[Any]) -> str:
    """The pipeline whose loader it is, for messages (a family's own loader names the pipeline it extends)."""
    return str(getattr(loader_class, "pipeline_name", loader_class.__name__))


def peft_name(name: str) -> str:
    """The adapter's name inside the model: PEFT keys its layers by name in module dicts, where '.' and '/' are
    not allowed."""
    return "lora_" + hashlib.sha256(name.encode()).hexdigest()[:16]
