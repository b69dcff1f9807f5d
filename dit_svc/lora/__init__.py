"""LoRA adapters on the DiT: the directory they live in and the checks a file passes before any rank loads it
(directory.py, checks.py), the cache of adapters loaded on each rank for the requests that name them
(cache.py), and the adapters fused in at startup (fused.py).

Adapters are safetensors files in --lora-dir, read and loaded by diffusers' own LoRA loaders through the
family's pipeline class. Outside a request every LoRA layer is disabled, so the transformer computes the base
model exactly; only fused mode changes the base weights, once at startup.
"""

from __future__ import annotations

from dit_svc.lora.cache import AdapterCache
from dit_svc.lora.checks import Adapter, read_adapter
from dit_svc.lora.directory import adapter_path, list_adapters, load_bytes
from dit_svc.lora.fused import fuse_adapters, parse_fused, served_model_id
from dit_svc.lora.settings import AdapterError, LoraSettings, peft_name

__all__ = [
    "Adapter",
    "AdapterCache",
    "AdapterError",
    "LoraSettings",
    "adapter_path",
    "fuse_adapters",
    "list_adapters",
    "load_bytes",
    "parse_fused",
    "peft_name",
    "read_adapter",
    "served_model_id",
]
