"""Writing a checkpoint's transformer as a GGUF file (`stagediff init-model ... --gguf Q8_0`).

GGUF (llama.cpp's file format) stores each weight in blocks of 32 values that share one scale (Q8_0: int8
values; Q4_0: 4-bit values; Q5_0, Q5_1, Q4_1 likewise), which is how many users fit a large DiT on a small
GPU. The published GGUF DiTs keep the original model's tensor names, quantize the linear layers of the
repeated blocks and keep everything else (embeddings, norms, biases, the modulation tables, the output head)
in float32. `write_gguf` writes that layout with the `gguf` package's own quantizer and writer:

- a 2-D weight of a linear layer inside `blocks.*` whose rows are a whole number of the type's blocks is
  stored in the requested type; every other tensor in float32;
- names are the family's original ones (`Family.gguf_names`), so that diffusers' `from_single_file`
  renames them exactly as it renames a downloaded file.

`convert_checkpoint` replaces each transformer component's safetensors weights by one such file, leaving
its config.json: the folder then looks like what a user assembles from a diffusers repository's configs and
a downloaded GGUF file, and the DiT stage loads it (stagekit/gguf.py).

The `gguf` package quantizes the legacy types only; the k-quants (Q4_K, Q5_K, Q6_K, ...) it can read but not
write, so files of those types come from llama.cpp's tools, and the stage loads them like any other.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from families.base import Family

if TYPE_CHECKING:  # torch is imported lazily
    import torch

logger = logging.getLogger(__name__)

# The types `init-model --gguf` writes: those the gguf package quantizes and diffusers dequantizes.
WRITABLE_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
TRANSFORMER_COMPONENTS = ("transformer", "transformer_2")
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def gguf_file_name(quant_type: str) -> str:
    return f"diffusion_pytorch_model-{quant_type}.gguf"


def original_names(family: Family) -> Callable[[str], str]:
    """The family's function from a diffusers state-dict key to the name GGUF files give that tensor."""
    if not family.gguf_names:
        raise ValueError(f"the {family.name} family has no GGUF layout; --gguf is for families with one")
    return family.load("gguf_names")


def write_gguf(
    component: Path, quant_type: str, rename: Callable[[str], str], arch: str, out: Path | None = None
) -> Path:
    """Writes `component`'s safetensors weights as one GGUF file: `out`, by default
    `component/diffusion_pytorch_model-<quant_type>.gguf`."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    if quant_type not in WRITABLE_TYPES:
        raise ValueError(f"--gguf {quant_type}: not a type this can write; allowed: {', '.join(WRITABLE_TYPES)}")
    qtype = gguf.GGMLQuantizationType[quant_type]
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    out = out if out is not None else component / gguf_file_name(quant_type)
    writer = gguf.GGUFWriter(out, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    quantized = kept = 0
    for file in sorted(component.glob("*.safetensors")):
        with safe_open(file, framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = weights.get_tensor(key).to(torch.float32)
                values = tensor.numpy()
                if key.startswith("blocks.") and key.endswith(".weight") and _is_quantizable(tensor, block_size):
                    writer.add_tensor(rename(key), gguf.quants.quantize(values, qtype), raw_dtype=qtype)
                    quantized += 1
                else:
                    writer.add_tensor(rename(key), np.ascontiguousarray(values))
                    kept += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    logger.info("%s: %d tensors in %s, %d kept in float32", out, quantized, quant_type, kept)
    return out


def _is_quantizable(tensor: torch.Tensor, block_size: int) -> bool:
    return tensor.ndim == 2 and tensor.shape[1] % block_size == 0


def convert_checkpoint(checkpoint: Path, family: Family, quant_type: str) -> list[Path]:
    """Replaces the safetensors weights of each transformer component of `checkpoint` by a GGUF file."""
    rename = original_names(family)
    index = json.loads((checkpoint / "model_index.json").read_text())
    written = []
    for name in TRANSFORMER_COMPONENTS:
        if (index.get(name) or [None, None])[1] is None:
            continue
        component = checkpoint / name
        written.append(write_gguf(component, quant_type, rename, family.gguf_arch))
        for file in component.iterdir():
            if file.name.endswith(WEIGHT_SUFFIXES):
                file.unlink()
    return written
