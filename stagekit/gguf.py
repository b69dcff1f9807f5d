"""GGUF transformer weights: `--quantization gguf`, or a `.gguf` file in the checkpoint's transformer folder.

A GGUF file stores each linear weight of the DiT in blocks of 32 or 256 values sharing a scale (Q8_0, Q4_0,
Q4_K, ...). A family's denoiser loads it with diffusers' own code, as a diffusers pipeline given the file would:

    Model.from_single_file(tensors, config=<checkpoint>, subfolder=<component>,
                           quantization_config=GGUFQuantizationConfig(compute_dtype=dtype), torch_dtype=dtype)

Each quantized weight stays packed as a `GGUFParameter` in a `GGUFLinear` that dequantizes it to the stage's
--dtype on every call, the other tensors cast as the model class casts them: the frames are the pipeline's. The
one departure: `read_gguf_state_dict` reads the tensors as views of one copy-on-write mapping of the file, since
copies hold a transformer's bytes twice while it loads (BENCHMARKS.md, "Loading GGUF"). diffusers reads the file
unchecked, so `check_gguf_file` reads the header and refuses at startup, naming the tensor, a truncated file, a
tensor type it cannot dequantize and a name that does not map.

A transformer folder is served from GGUF when `--quantization gguf` says so, or when it holds a `.gguf` file and
no safetensors weights (`quantization_for`). Every rank loads the whole file: Ulysses, Ring and CFG parallelism
run unchanged on GGUF layers; tensor parallelism and HSDP are refused (the packed blocks would have to be sharded
with their scales, which DTensor cannot do).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# How many names a refusal lists before it says how many more there are.
_LISTED = 5


@dataclass(frozen=True)
class GgufContents:
    """What a checked GGUF file holds: its tensors by storage type, and its bytes."""

    path: Path
    types: dict[str, int]
    file_bytes: int

    def summary(self) -> str:
        types = ", ".join(f"{count} {name}" for name, count in sorted(self.types.items()))
        return f"{self.path.name}: {types} tensors, {self.file_bytes / 2**20:.1f} MiB"


def gguf_files(component: Path) -> list[Path]:
    return sorted(component.glob("*" + GGUF_SUFFIX))


def has_safetensors(component: Path) -> bool:
    return any(component.glob("*.safetensors"))


def gguf_file(component: Path) -> Path:
    """The one `.gguf` file of a transformer folder (ValueError when there is none, or several)."""
    files = gguf_files(component)
    if not files:
        raise ValueError(
            f"{component} holds no {GGUF_SUFFIX} file; put one there (`stagediff init-model ... --gguf Q8_0` "
            "writes one)"
        )
    if len(files) > 1:
        names = ", ".join(file.name for file in files)
        raise ValueError(f"{component} holds several GGUF files ({names}); keep the one to serve")
    return files[0]


def quantization_for(flag: str | None, model_dir: Path, components: tuple[str, ...]) -> str | None:
    """The quantization the stage serves: --quantization, or "gguf" when a transformer folder holds a GGUF file
    and no safetensors weights (a folder with both serves the safetensors unless --quantization gguf says so).

    Refuses --quantization gguf without a GGUF file, and fp8/int8 on weights that exist only as GGUF.
    """
    if flag == "gguf":
        for name in components:
            gguf_file(model_dir / name)
        return "gguf"
    gguf_only = [model_dir / name for name in components if gguf_files(model_dir / name)]
    gguf_only = [folder for folder in gguf_only if not has_safetensors(folder)]
    if not gguf_only:
        return flag
    if flag is not None:
        raise ValueError(
            f"--quantization {flag}: {gguf_only[0]} holds GGUF weights only, which are quantized already; serve "
            "them with --quantization gguf"
        )
    logger.info("%s holds GGUF weights only: serving them (--quantization gguf)", gguf_only[0])
    return "gguf"


def check_gguf_file(path: Path, model_class: type[nn.Module], component: Path) -> GgufContents:
    """Reads the header of a GGUF file and checks that `model_class` (configured by `component`) can load it.

    Raises ValueError naming the problem: not a GGUF file, truncated, a tensor type diffusers cannot
    dequantize, names that do not map to the model's, a shape that differs from the model's, or a quantized
    tensor where the model has no linear layer to dequantize it.
    """
    import gguf
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # noqa: BLE001 - whatever the parser trips on, the file is not usable
        raise ValueError(
            f"{path}: not a readable GGUF file, damaged or truncated ({type(error).__name__}: {error})"
        ) from None

    unquantized = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    readable = unquantized | set(SUPPORTED_GGUF_QUANT_TYPES)
    unsupported = [tensor for tensor in reader.tensors if tensor.tensor_type not in readable]
    if unsupported:
        first = unsupported[0]
        allowed = ", ".join(sorted(t.name for t in readable))
        raise ValueError(
            f"{path}: tensor '{first.name}' is stored as {first.tensor_type.name}, which cannot be dequantized "
            f"({len(unsupported)} such tensors); supported types: {allowed}"
        )

    # The file's names through diffusers' own renaming, on shape-only tensors (GGUF lists dimensions innermost
    # first). The quantized ones are renamed on their own, to find where they land.
    rename = SINGLE_FILE_LOADABLE_CLASSES[model_class.__name__]["checkpoint_mapping_fn"]
    shapes = {tensor.name: tuple(int(n) for n in reversed(tensor.shape)) for tensor in reader.tensors}
    quantized = [tensor.name for tensor in reader.tensors if tensor.tensor_type not in unquantized]
    mapped = rename({name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    mapped_quantized = rename({name: torch.empty(shapes[name], device="meta") for name in quantized})
    with torch.device("meta"):
        model = model_class.from_config(model_class.load_config(component))
    expected = model.state_dict()
    _refuse_mismatched_names(path, set(mapped), set(expected))
    for key, tensor in mapped.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"{path}: tensor for '{key}' has shape {list(tensor.shape)}, the model's config "
                f"({component / 'config.json'}) gives {list(expected[key].shape)}"
            )
    linear_weights = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    not_linear = sorted(set(mapped_quantized) - linear_weights)
    if not_linear:
        raise ValueError(
            f"{path}: '{not_linear[0]}' is quantized but is not a linear layer's weight; only linear weights can "
            "be dequantized on the fly (store the others as F32 or F16)"
        )
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    return GgufContents(path=path, types=dict(types), file_bytes=path.stat().st_size)


def _refuse_mismatched_names(path: Path, found: set[str], expected: set[str]) -> None:
    missing, extra = sorted(expected - found), sorted(found - expected)
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} of the model's tensors are missing ({', '.join(missing[:_LISTED])}"
            f"{', ...' if len(missing) > _LISTED else ''})"
        )
    if extra:
        parts.append(
            f"{len(extra)} tensors are not the model's ({', '.join(extra[:_LISTED])}"
            f"{', ...' if len(extra) > _LISTED else ''})"
        )
    raise ValueError(f"{path}: tensor names do not match the model after renaming: {'; '.join(parts)}")


def read_gguf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as diffusers' `load_gguf_checkpoint` makes them (a `GGUFParameter` with its type for
    each quantized tensor, a plain tensor for F32 and F16), but as views of one copy-on-write mapping of the file
    rather than copies of it: loading then holds the file's bytes once, in the page cache, not twice."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter

    unquantized = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    reader = gguf.GGUFReader(path, mode="c")
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        data = torch.from_numpy(tensor.data)
        quantized = tensor.tensor_type not in unquantized
        state_dict[tensor.name] = GGUFParameter(data, quant_type=tensor.tensor_type) if quantized else data
    return state_dict


def load_gguf_transformer(
    model_class: type[nn.Module], component: Path, *, device: torch.device, dtype: torch.dtype
) -> nn.Module:
    """The transformer of `component` from its GGUF file, checked first, loaded by diffusers' from_single_file."""
    from diffusers import GGUFQuantizationConfig

    path = gguf_file(component)
    contents = check_gguf_file(path, model_class, component)
    model = model_class.from_single_file(
        read_gguf_state_dict(path),
        config=str(component.parent),
        subfolder=component.name,
        quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
        torch_dtype=dtype,
    )
    logger.info("loaded %s", contents.summary())
    return model.to(device).eval()
