"""LoRA adapters on the DiT: where they live, the checks a file passes before any rank loads it, the cache of
loaded adapters on each rank, and the adapters fused in at startup.

Adapters are safetensors files in --lora-dir: `NAME.safetensors` is the adapter NAME, which the tenants file
lets tenants use; `TENANT/NAME.safetensors` is "TENANT/NAME", private to that tenant (the orchestrator checks
both, services/orchestrator/lora_access.py).

Reading and loading are diffusers' own, through the family's pipeline class (`Family.pipeline`, e.g.
WanPipeline): its `lora_state_dict` converts the community formats it knows to its own (Wan's
"diffusion_model." and musubi files, for instance), and `load_lora_into_transformer` injects PEFT's LoRA layers
around the transformer's linears, into the `transformer` as `pipe.load_lora_weights` does. For each request
`set_adapters` picks the request's adapters and scales; after it `disable_lora` leaves every layer computing its
base output alone, the base model's output exactly. The base weights never change, except by `fuse_adapters`
(--lora), once at startup.

Before any rank loads a file, `read_adapter` checks it on rank 0 and names what is wrong: its size, its format,
keys that match no linear layer of the transformer, shapes that do not fit, ranks, alphas, non-finite weights.
The ranks of a group then load only what rank 0 has checked, so a bad adapter fails its request, never the
group (services/rank_group.py ends a group one of whose ranks raises).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from dit_svc.options import DEFAULT_LORA_CACHE_BYTES, DEFAULT_LORA_MAX_FILE_BYTES, DEFAULT_MAX_LORAS_PER_REQUEST
from services.errors import NotFoundError, RequestError
from services.validation import LORA_NAME
from services.weights import read_safetensors
from stagediff.v1 import stages_pb2

logger = logging.getLogger(__name__)

ADAPTER_SUFFIX = ".safetensors"
# diffusers' key for the PEFT config it saves beside the weights (diffusers.loaders.lora_base).
ADAPTER_METADATA_KEY = "lora_adapter_metadata"
# The most adapters the stage lists (StageInfo stays small); more files are ignored, with a warning.
MAX_LISTED_ADAPTERS = 1024
# Ranks above this are full fine-tunes in disguise, not adapters.
MAX_RANK = 1024
# The tensors of a layer's adapter in diffusers' format: down (lora_A), up (lora_B) and up's optional bias.
LORA_PARTS = ("lora_A.weight", "lora_B.weight", "lora_B.bias")


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


# ------------------------------------------------------------------------------------------ the directory --


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
    elements (not the scalar alphas) at `itemsize` bytes each, as `_check_layers` counts them; 0 when the header
    cannot be read (the request that names it is refused by `check`)."""
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


# ------------------------------------------------------------------------------------- reading and checks --


@dataclass
class Adapter:
    """An adapter read and checked: diffusers' state dict for the transformer ("transformer." keys), the PEFT
    config saved with it (None for files without one), and the bytes its layers take in the model's dtype."""

    name: str
    state_dict: dict[str, torch.Tensor]
    metadata: dict | None
    bytes: int
    # The file it came from, as (size, mtime_ns): a file replaced since is read again.
    stamp: tuple[int, int]


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _positive_numbers(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1e6 for v in value.values()
    )


def _file_metadata(name: str, path: Path) -> dict | None:
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
    name: str, path: Path, pipeline_class: type, transformer: nn.Module, max_file_bytes: int, num_threads: int = 4
) -> Adapter:
    """Reads adapter `name` with the multi-thread loader and the family's diffusers converter, and checks it
    against `transformer` (not modified); raises AdapterError naming what is wrong."""
    stamp = _stamp(path)
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
        state_dict = pipeline_class.lora_state_dict(tensors)
        expand = getattr(pipeline_class, "_maybe_expand_t2v_lora_for_i2v", None)
        if expand is not None:  # Wan's image-to-video transformers take a text-to-video adapter, as diffusers does
            state_dict = expand(transformer=transformer, state_dict=state_dict)
    except Exception as error:  # an alpha that is not a number, keys of an unknown layout, ...
        raise AdapterError(
            f"lora '{name}': {pipeline_class.__name__}'s loader cannot read it ({type(error).__name__}: {error})"
        ) from None
    dtype = next(transformer.parameters()).dtype
    adapter = Adapter(name, state_dict, metadata, _check_layers(name, state_dict, transformer, dtype), stamp)
    logger.info(
        "lora '%s': read and checked in %.3f s (%d tensors, %d bytes in the model's dtype)",
        name,
        time.perf_counter() - started,
        len(state_dict),
        adapter.bytes,
    )
    return adapter


def _linears(transformer: nn.Module) -> dict[str, nn.Linear]:
    """The transformer's linear layers by path; a layer PEFT already wraps (another adapter is loaded) counts as
    the linear it wraps."""
    linears = {}
    for path, module in transformer.named_modules():
        base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
        if isinstance(base, nn.Linear) and ".base_layer" not in path:
            linears.setdefault(path, base)
    return linears


def _check_layers(name: str, state_dict: dict[str, torch.Tensor], transformer: nn.Module, dtype: torch.dtype) -> int:
    """Every key is lora_A/lora_B (and lora_B's bias) of a linear layer of the transformer, with shapes that fit
    it and one rank per layer; every weight finite. Returns the bytes of the adapter's layers in `dtype`."""
    if not state_dict:
        raise AdapterError(f"lora '{name}': holds no LoRA weights")
    linears = _linears(transformer)
    layers: dict[str, dict[str, torch.Tensor]] = {}
    unmatched = []
    for key, tensor in state_dict.items():
        inner = key.removeprefix("transformer.")
        part = next((part for part in LORA_PARTS if inner.endswith("." + part)), None)
        if part is None or inner == key:
            unmatched.append(key)
            continue
        layers.setdefault(inner[: -len(part) - 1], {})[part] = tensor
    if unmatched:
        raise AdapterError(
            f"lora '{name}': keys that are not LoRA weights of the transformer: {', '.join(unmatched[:5])}"
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


# ---------------------------------------------------------------------------------------- the rank's cache --


def peft_name(name: str) -> str:
    """The adapter's name inside the model: PEFT keys its layers by name in module dicts, where '.' and '/' are
    not allowed."""
    return "lora_" + hashlib.sha256(name.encode()).hexdigest()[:16]


@dataclass
class _Loaded:
    bytes: int
    stamp: tuple[int, int]


class AdapterCache:
    """The adapters loaded into this rank's transformer, least recently used first, at most `cache_bytes` of them.

    Every rank of a DiT group holds one and sees the same requests in the same order, so each loads and evicts
    as the others do. Outside `applied` every LoRA layer is disabled: the transformer computes the base model.
    """

    def __init__(self, transformer: nn.Module, settings: LoraSettings, num_threads: int = 4) -> None:
        import diffusers

        self.transformer = transformer
        self.settings = settings
        self.pipeline_class = getattr(diffusers, settings.pipeline)
        self.num_threads = num_threads
        self.loaded: OrderedDict[str, _Loaded] = OrderedDict()
        # Read and checked by `check`, not loaded yet (the request's next `prepare` loads them).
        self.checked: dict[str, Adapter] = {}
        self.hits = 0
        self.misses = 0

    @property
    def loaded_bytes(self) -> int:
        return sum(entry.bytes for entry in self.loaded.values())

    def check(self, loras: tuple[tuple[str, float], ...]) -> None:
        """Reads and checks each of the request's adapters that is not loaded (or whose file changed since),
        without touching the model; raises NotFoundError or AdapterError naming the adapter. Rank 0 of a group
        runs it before the group does, so that a bad adapter fails only its request."""
        wanted = [name for name, _ in loras]
        self.checked = {name: adapter for name, adapter in self.checked.items() if name in wanted}
        if not wanted:
            return
        directory = self.settings.directory
        if directory is None:
            raise NotFoundError(f"lora '{wanted[0]}': the DiT serves no adapters per request (no --lora-dir)")
        for name in wanted:
            path = adapter_path(directory, name)
            stamp = _stamp(path)
            entry = self.loaded.get(name)
            if (entry is not None and entry.stamp == stamp) or (
                name in self.checked and self.checked[name].stamp == stamp
            ):
                continue
            self.checked[name] = read_adapter(
                name, path, self.pipeline_class, self.transformer, self.settings.max_file_bytes, self.num_threads
            )
        needed = sum(self.checked[name].bytes if name in self.checked else self.loaded[name].bytes for name in wanted)
        if needed > self.settings.cache_bytes:
            raise AdapterError(
                f"loras: {', '.join(wanted)} take {needed} bytes on the DiT, more than its --lora-cache-bytes "
                f"{self.settings.cache_bytes}"
            )

    def prepare(self, loras: tuple[tuple[str, float], ...]) -> None:
        """Loads the request's adapters that are not loaded, evicting the least recently used others beyond
        --lora-cache-bytes."""
        self.check(loras)
        wanted = [name for name, _ in loras]
        fresh = [self.checked.pop(name) for name in wanted if name in self.checked]
        for adapter in fresh:
            if adapter.name in self.loaded:  # its file was replaced
                self._unload(adapter.name)
        self.hits += len(wanted) - len(fresh)
        self.misses += len(fresh)
        incoming = sum(adapter.bytes for adapter in fresh)
        for name in list(self.loaded):
            if self.loaded_bytes + incoming <= self.settings.cache_bytes:
                break
            if name not in wanted:
                self._unload(name)
        for adapter in fresh:
            self._load(adapter)
        for name in wanted:
            self.loaded.move_to_end(name)

    def _load(self, adapter: Adapter) -> None:
        started = time.perf_counter()
        with warnings.catch_warnings():
            # PEFT warns at every adapter after the first that the model holds several: that is the point here.
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            self.pipeline_class.load_lora_into_transformer(
                adapter.state_dict,
                transformer=self.transformer,
                adapter_name=peft_name(adapter.name),
                metadata=adapter.metadata,
            )
        self.transformer.disable_lora()
        self.loaded[adapter.name] = _Loaded(adapter.bytes, adapter.stamp)
        logger.info(
            "lora '%s': loaded into the transformer in %.3f s (%d adapters, %d bytes cached)",
            adapter.name,
            time.perf_counter() - started,
            len(self.loaded),
            self.loaded_bytes,
        )

    def _unload(self, name: str) -> None:
        with warnings.catch_warnings():
            # Deleting the adapter PEFT last activated makes it name another active: every layer is disabled anyway.
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.transformer.delete_adapters([peft_name(name)])
        del self.loaded[name]
        logger.info("lora '%s': evicted from the cache", name)

    @contextlib.contextmanager
    def applied(self, loras: tuple[tuple[str, float], ...]) -> Iterator[None]:
        """The request's adapters at their scales for the duration; the base model before and after."""
        if not loras:
            yield
            return
        self.prepare(loras)
        self.transformer.enable_lora()
        self.transformer.set_adapters([peft_name(name) for name, _ in loras], [scale for _, scale in loras])
        try:
            yield
        finally:
            self.transformer.disable_lora()


# -------------------------------------------------------------------------------------------- fused mode --


def parse_fused(values: list[str]) -> tuple[tuple[str, float], ...]:
    """--lora NAME[:SCALE] values as (name, scale); raises ValueError naming the bad value."""
    fused = []
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
    import diffusers

    if settings.directory is None:
        raise ValueError("--lora needs --lora-dir, the directory its adapters are in")
    pipeline_class = getattr(diffusers, settings.pipeline)
    for name, scale in settings.fused:
        path = adapter_path(settings.directory, name)
        adapter = read_adapter(name, path, pipeline_class, transformer, settings.max_file_bytes, num_threads)
        internal = peft_name(name)
        pipeline_class.load_lora_into_transformer(
            adapter.state_dict, transformer=transformer, adapter_name=internal, metadata=adapter.metadata
        )
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
