"""The adapter directory (--lora-dir): which adapters it holds and where each one's file is.

`NAME.safetensors` is the adapter NAME, which the tenants file lets tenants use; `TENANT/NAME.safetensors` is
"TENANT/NAME", private to that tenant (the orchestrator checks both, services/orchestrator/lora_access.py).
An adapter name is never a path of its own: it matches services.validation.LORA_NAME or is not found.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import safetensors

from services.validation import LORA_NAME
from stagediff.v1 import stages_pb2
from stagekit.errors import NotFoundError

logger = logging.getLogger(__name__)

ADAPTER_SUFFIX = ".safetensors"
# The most adapters the stage lists (StageInfo stays small); more files are ignored, with a warning.
MAX_LISTED_ADAPTERS = 1024


def adapter_path(directory: Path, name: str) -> Path:
    """The file of adapter `name` (NOT_FOUND when there is none); `name` is never a path of its own."""
    if not LORA_NAME.fullmatch(name):
        raise NotFoundError(f"lora '{name[:64]}': not an adapter name")
    path = directory / f"{name}{ADAPTER_SUFFIX}"
    if not path.is_file():
        raise NotFoundError(f"lora '{name}': no such adapter on the DiT (no {name}{ADAPTER_SUFFIX} in its --lora-dir)")
    return path


def load_bytes(path: Path, itemsize: int) -> int:
    """The bytes an adapter's weights take loaded, estimated from its file's header: its floating-point tensors'
    elements (not the scalar alphas) at `itemsize` bytes each, as the checks count them (checks.py); 0 when the
    header cannot be read (the request that names it is refused by `AdapterCache.check`)."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as handle:
            elements = 0
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                tensor = handle.get_slice(key)
                shape = tensor.get_shape()
                if shape and tensor.get_dtype().startswith(("F", "BF")) and not key.endswith(".alpha"):
                    elements += math.prod(shape)
    except Exception:  # not a safetensors file: listed, and refused with its reason when a request names it
        return 0
    return elements * itemsize


def list_adapters(directory: Path, itemsize: int = 0) -> list[stages_pb2.LoraInfo]:
    """The adapters in `directory` (NAME.safetensors) and in its tenants' subdirectories (TENANT/NAME), by name;
    files whose names are not adapter names are skipped. With the model dtype's `itemsize`, each says the bytes
    it takes loaded (`load_bytes`)."""
    found: list[stages_pb2.LoraInfo] = []
    candidates = sorted(directory.glob(f"*{ADAPTER_SUFFIX}")) + sorted(directory.glob(f"*/*{ADAPTER_SUFFIX}"))
    for path in candidates:
        name = path.relative_to(directory).as_posix().removesuffix(ADAPTER_SUFFIX)
        if not LORA_NAME.fullmatch(name) or not path.is_file():
            continue
        if len(found) == MAX_LISTED_ADAPTERS:
            logger.warning("--lora-dir holds more than %d adapters; the rest are not served", MAX_LISTED_ADAPTERS)
            break
        loaded = load_bytes(path, itemsize) if itemsize else 0
        found.append(stages_pb2.LoraInfo(name=name, bytes=path.stat().st_size, load_bytes=loaded))
    return found
