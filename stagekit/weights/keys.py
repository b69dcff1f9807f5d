"""Finding a component's safetensors files, reading their headers, renaming keys and checking them.

Only the headers are read (8-byte length, then JSON): every key the model expects must be in the files once,
none may be extra and shapes must match, before any tensor is read. A mismatch raises ValueError naming the
keys.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

# safetensors dtype names -> torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are and what they are."""

    file: Path
    name: str  # name in the file
    key: str  # name in the model (after any renaming the model class declares)
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of one component: the shards its index lists, or its single file."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(f"{directory} holds several safetensors indexes: {[p.name for p in indexes]}")
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        return [directory / name for name in files]
    files = sorted(directory.glob("*.safetensors"))
    if len(files) != 1:
        found = [p.name for p in files] or "none"
        raise ValueError(f"{directory}: expected one *.safetensors file or a *.safetensors.index.json, found {found}")
    return files


def read_headers(files: list[Path]) -> list[TensorEntry]:
    """Every tensor of every file, from the safetensors headers only (8-byte length, then JSON)."""
    entries: list[TensorEntry] = []
    for path in files:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            entries.append(
                TensorEntry(
                    file=path,
                    name=name,
                    key=name,
                    dtype=DTYPES[info["dtype"]],
                    shape=tuple(info["shape"]),
                    offset=data_start + begin,
                    nbytes=end - begin,
                )
            )
    return entries


def _key_renamer(model: nn.Module, library: str) -> Callable[[str], str]:
    """Maps checkpoint names to model names where the model class declares renamings (transformers 5)."""
    if library != "transformers":
        return lambda name: name
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta_state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)

    def rename(name: str) -> str:
        key, converter = rename_source_key(name, renamings, converters, prefix, meta_state)
        if key not in meta_state and name in meta_state:
            key, converter = name, None
        if converter is not None:
            raise NotImplementedError(
                f"{type(model).__name__}: checkpoint tensor {name!r} needs a conversion ({converter}), "
                "which only from_pretrained performs"
            )
        return key

    return rename


def renamed(entries: list[TensorEntry], model: nn.Module, library: str) -> list[TensorEntry]:
    """`entries` with each key as the model names it (the renamings its class declares)."""
    rename = _key_renamer(model, library)
    return [dataclasses.replace(entry, key=rename(entry.name)) for entry in entries]


def listed_keys(keys: Iterable[str], limit: int = 20) -> str:
    """At most `limit` of `keys`, sorted and joined, for an error message."""
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def check_keys(
    model_class: type[nn.Module],
    directory: Path,
    meta_state: dict[str, torch.Tensor],
    entries: list[TensorEntry],
    wanted: set[str],
    tied: dict[str, str],
    filtered: bool,
) -> None:
    """Every wanted key is in the files once with the right shape, and the files hold nothing else."""
    in_files: dict[str, TensorEntry] = {}
    duplicates = set()
    for entry in entries:
        if entry.key in in_files:
            duplicates.add(entry.key)
        in_files[entry.key] = entry
    unexpected = set(in_files) - set(meta_state)
    missing = {key for key in wanted - set(in_files) if not (key in tied and tied[key] in in_files)}
    where = f"{model_class.__name__} from {directory}"
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {listed_keys(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {listed_keys(unexpected)}")
    if duplicates:
        problems.append(f"keys stored more than once ({len(duplicates)}): {listed_keys(duplicates)}")
    mismatched = [
        f"{key} (file {list(entry.shape)}, model {list(meta_state[key].shape)})"
        for key, entry in in_files.items()
        if key in meta_state and tuple(meta_state[key].shape) != entry.shape
    ]
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): {listed_keys(mismatched)}")
    if problems:
        raise ValueError(f"cannot load {where}: " + "; ".join(problems))
    if filtered:
        logger.info("%s: reading %d of %d keys (tensor_filter)", where, len(wanted & set(in_files)), len(in_files))
