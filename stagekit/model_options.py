"""What a family's denoiser asks of the DiT stage's model options.

The stage builds its options from its flags (dit_svc/model_options.py `ModelOptions`: adapters fused in,
weight-only quantization, CPU offload, regional compilation) and hands them to the family's denoiser, which
reads `quantization` to pick its loader (a GGUF transformer is loaded quantized, stagekit/gguf.py) and calls
`apply` once on the experts it loaded, before its parallel plan: fused adapters change the full-precision
weights, quantization must see the weights on the device, and offload moves whatever quantization left.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class TransformerOptions(Protocol):
    """The stage's options for the transformers of a denoiser (dit_svc/model_options.py ModelOptions)."""

    @property
    def quantization(self) -> str | None:
        """ "fp8" or "int8" (applied by `apply`), "gguf" (the loader reads the GGUF file), or None."""
        ...

    def apply(self, experts: list[nn.Module], device: torch.device, load_threads: int) -> None:
        """Applies the options to the experts in place, right after loading them and before any parallel plan."""
        ...
