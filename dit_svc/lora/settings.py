"""The DiT's adapter options, the error an adapter the stage cannot apply raises, and the name an adapter
takes inside the model."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

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
    # diffusers pipeline class whose loader reads the family's adapters (Family.pipeline).
    pipeline: str = ""

    @property
    def per_request(self) -> bool:
        """Requests may name adapters (a directory, and --max-loras-per-request above 0)."""
        return self.directory is not None and self.max_per_request > 0


def peft_name(name: str) -> str:
    """The adapter's name inside the model: PEFT keys its layers by name in module dicts, where '.' and '/' are
    not allowed."""
    return "lora_" + hashlib.sha256(name.encode()).hexdigest()[:16]
