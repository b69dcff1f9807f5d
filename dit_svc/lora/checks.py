"""Reading an adapter and the checks it passes before any rank loads it.

Reading is diffusers' own, through the family's pipeline class (`Family.pipeline`, e.g. WanPipeline) or the
family's loader that extends it (`Family.lora_loader`): its `lora_state_dict` converts the community formats it
knows to its own (Wan's "diffusion_model." and musubi files; FLUX.1's kohya, XLabs and ComfyUI files, and BFL's
lora_A/lora_B names through families/flux/lora.py, for instance). Where that loader keeps the alphas of a PEFT-style
file apart from the weights (FluxPipeline's `return_alphas`), they are kept with the adapter and handed to its
`load_lora_into_transformer` (`Adapter.load_into`), as `pipe.load_lora_weights` hands them. `read_adapter` then
checks the result on rank 0 and names what is wrong: its size, its format, keys the loader left in a layout no
layer of the transformer has (a layout diffusers does not convert, or another model's), shapes that do not fit,
ranks, alphas, non-finite weights. The ranks of a group load only what rank 0 has checked, so a bad adapter
fails its request, never the group (services/rank_group/ ends a group one of whose ranks raises).
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from torch import nn

from dit_svc.lora.settings import AdapterError, loader_name
from stagekit.weights import read_safetensors

logger = logging.getLogger(__name__)

# diffusers' key for the PEFT config it saves beside the weights (diffusers.loaders.lora_base).
ADAPTER_METADATA_KEY = "lora_adapter_metadata"
# Ranks above this are full fine-tunes in disguise, not adapters.
MAX_RANK = 1024
# The tensors of a layer's adapter in diffusers' format: down (lora_A), up (lora_B) and up's optional bias.
LORA_PARTS = ("lora_A.weight", "lora_B.weight", "lora_B.bias")


@dataclass
class Adapter:
    """An adapter read and checked: diffusers' state dict for the transformer ("transformer." keys), the PEFT
    config saved with it (None for files without one), and the bytes its layers take in the model's dtype."""

    name: str
    state_dict: dict[str, torch.Tensor]
    metadata: dict[str, Any] | None
    bytes: int
    # The file it came from, as (size, mtime_ns): a file replaced since is read again.
    stamp: tuple[int, int]
    # The alphas the loader's conversion keeps apart from the weights, by key (FluxPipeline's network alphas of
    # a PEFT-style file with ".alpha" keys); None where it keeps none.
    alphas: dict[str, torch.Tensor] | None = None

    def load_into(self, pipeline_class: type[Any], transformer: nn.Module, adapter_name: str) -> None:
        """Injects the adapter's LoRA layers into `transformer` as `adapter_name`, as `pipe.load_lora_weights`
        does: the family's `load_lora_into_transformer`, given the alphas where it takes them."""
        options: dict[str, Any] = {}
        if "network_alphas" in inspect.signature(pipeline_class.load_lora_into_transformer).parameters:
            options["network_alphas"] = self.alphas
        pipeline_class.load_lora_into_transformer(
            self.state_dict, transformer=transformer, adapter_name=adapter_name, metadata=self.metadata, **options
        )


def file_stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _positive_numbers(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1e6 for v in value.values()
    )


def _file_metadata(name: str, path: Path) -> dict[str, Any] | None:
    """The PEFT config diffusers saves in the file's header (rank, alpha, target modules), checked to parse."""
    with safetensors.safe_open(str(path), framework="pt") as handle:
        raw = (handle.metadata() or {}).get(ADAPTER_METADATA_KEY)
    if raw is None:
        return None
    try:
        metadata = json.loads(raw)
    except json.JSONDecodeError as error:
        raise AdapterError(f"lora '{name}': its {ADAPTER_METADATA_KEY} header is not JSON ({error})") from None
    if not isinstance(metadata, dict):
        raise AdapterError(f"lora '{name}': its {ADAPTER_METADATA_KEY} header is not a JSON object")
    for key, value in metadata.items():
        field = key.rpartition(".")[2]
        if field in ("r", "lora_alpha") and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e6
        ):
            raise AdapterError(f"lora '{name}': {key} is {str(value)[:32]!r} in its header; expected a positive number")
        if field in ("rank_pattern", "alpha_pattern") and value and not _positive_numbers(value):
            raise AdapterError(f"lora '{name}': {key} in its header is not a map of positive numbers")
    return metadata


def read_adapter(
    name: str, path: Path, pipeline_class: type[Any], transformer: nn.Module, max_file_bytes: int, num_threads: int = 4
) -> Adapter:
    """Reads adapter `name` with the multi-thread loader and the family's diffusers converter, and checks it
    against `transformer` (not modified); raises AdapterError naming what is wrong."""
    stamp = file_stamp(path)
    if stamp[0] > max_file_bytes:
        raise AdapterError(f"lora '{name}': its file is {stamp[0]} bytes; the DiT takes at most {max_file_bytes}")
    started = time.perf_counter()
    try:
        tensors = read_safetensors(path, num_threads=num_threads)
        metadata = _file_metadata(name, path)
    except AdapterError:
        raise
    except Exception as error:  # a truncated file, a header that is not safetensors' JSON, an unknown dtype
        raise AdapterError(
            f"lora '{name}': not a readable safetensors file ({type(error).__name__}: {error})"
        ) from None
    try:
        state_dict, alphas = _converted(pipeline_class, tensors)
        expand = getattr(pipeline_class, "_maybe_expand_t2v_lora_for_i2v", None)
        if expand is not None:  # Wan's image-to-video transformers take a text-to-video adapter, as diffusers does
            state_dict = expand(transformer=transformer, state_dict=state_dict)
    except Exception as error:  # an alpha that is not a number, keys of an unknown layout, ...
        raise AdapterError(
            f"lora '{name}': {loader_name(pipeline_class)}'s loader cannot read it ({type(error).__name__}: {error})"
        ) from None
    for key, alpha in (alphas or {}).items():
        if not (torch.is_tensor(alpha) and alpha.numel() == 1 and bool(torch.isfinite(alpha).all())):
            raise AdapterError(f"lora '{name}': {key} is not one finite number")
    dtype = next(transformer.parameters()).dtype
    layers_bytes = _check_layers(name, state_dict, transformer, dtype, loader_name(pipeline_class))
    adapter = Adapter(name, state_dict, metadata, layers_bytes, stamp, alphas)
    logger.info(
        "lora '%s': read and checked in %.3f s (%d tensors, %d bytes in the model's dtype)",
        name,
        time.perf_counter() - started,
        len(state_dict),
        adapter.bytes,
    )
    return adapter


def _converted(
    pipeline_class: type[Any], tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """The file's tensors through the loader's `lora_state_dict`, with the alphas it keeps apart where it does."""
    if "return_alphas" in inspect.signature(pipeline_class.lora_state_dict).parameters:
        state_dict, alphas = pipeline_class.lora_state_dict(tensors, return_alphas=True)
        return state_dict, alphas or None
    return pipeline_class.lora_state_dict(tensors), None


def _linears(transformer: nn.Module) -> dict[str, nn.Linear]:
    """The transformer's linear layers by path; a layer PEFT already wraps (another adapter is loaded) counts as
    the linear it wraps."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    linears: dict[str, nn.Linear] = {}
    for path, module in transformer.named_modules():
        base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
        if isinstance(base, nn.Linear) and ".base_layer" not in path:
            linears.setdefault(path, base)
    return linears


def _check_layers(
    name: str, state_dict: dict[str, torch.Tensor], transformer: nn.Module, dtype: torch.dtype, loader: str
) -> int:
    """Every key is lora_A/lora_B (and lora_B's bias) of a linear layer of the transformer, with shapes that fit
    it and one rank per layer; every weight finite. Returns the bytes of the adapter's layers in `dtype`.
    `loader`: the pipeline class whose conversion made `state_dict`, named where keys are left unconverted."""
    if not state_dict:
        raise AdapterError(f"lora '{name}': holds no LoRA weights")
    linears = _linears(transformer)
    layers: dict[str, dict[str, torch.Tensor]] = {}
    unmatched: list[str] = []
    for key, tensor in state_dict.items():
        inner = key.removeprefix("transformer.")
        part = next((part for part in LORA_PARTS if inner.endswith("." + part)), None)
        if part is None or inner == key:
            unmatched.append(key)
            continue
        layers.setdefault(inner[: -len(part) - 1], {})[part] = tensor
    if unmatched:
        raise AdapterError(
            f"lora '{name}': keys that are not LoRA weights of the transformer (a text encoder's, which the DiT "
            f"does not apply, or a layout {loader}'s loader does not convert): {', '.join(unmatched[:5])}"
            + (f" and {len(unmatched) - 5} more" if len(unmatched) > 5 else "")
        )
    missing = sorted(module for module in layers if module not in linears)
    if missing:
        raise AdapterError(
            f"lora '{name}': {len(missing)} of its {len(layers)} layers match no linear layer of the transformer "
            f"(e.g. {', '.join(missing[:3])}); it was made for another model"
        )
    total = 0
    for module, parts in layers.items():
        linear = linears[module]
        down, up = parts.get("lora_A.weight"), parts.get("lora_B.weight")
        if down is None or up is None:
            raise AdapterError(f"lora '{name}': {module} has {'lora_B' if down is None else 'lora_A'} without its pair")
        rank = down.shape[0] if down.ndim == 2 else -1
        if down.ndim != 2 or up.ndim != 2 or not 1 <= rank <= MAX_RANK:
            raise AdapterError(
                f"lora '{name}': {module} has lora_A {list(down.shape)} and lora_B {list(up.shape)}; expected "
                f"[r, in] and [out, r] with 1 <= r <= {MAX_RANK}"
            )
        bias = parts.get("lora_B.bias")
        if (
            tuple(down.shape) != (rank, linear.in_features)
            or tuple(up.shape) != (linear.out_features, rank)
            or (bias is not None and tuple(bias.shape) != (linear.out_features,))
        ):
            raise AdapterError(
                f"lora '{name}': {module} has lora_A {list(down.shape)} and lora_B {list(up.shape)}; the layer "
                f"takes [r, {linear.in_features}] and [{linear.out_features}, r]: it was made for another model"
            )
        for part, tensor in parts.items():
            if not tensor.is_floating_point():
                raise AdapterError(f"lora '{name}': {module}.{part} is {tensor.dtype}, not floating point")
            if not bool(torch.isfinite(tensor).all()):
                raise AdapterError(f"lora '{name}': {module}.{part} holds NaN or infinite values")
            total += tensor.numel() * dtype.itemsize
    return total
