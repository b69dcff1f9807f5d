"""The DiT stage's options for its transformers: adapters fused in (--lora), weight-only quantization, then
CPU offload; whether the stage compiles their blocks (`compile`, applied by dit_svc/denoise.py `make_denoiser`
after everything else); and the adapters requests may apply (`lora`, dit_svc/lora/).

A family's denoiser sees them as stagekit/model_options.py `TransformerOptions`: every rank of a DiT group
calls `apply` on its experts right after loading them and before any parallel layout: fused adapters change
the full-precision weights, quantization must see the weights on the device, and offload moves whatever
quantization left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from dit_svc.lora import LoraSettings, fuse_adapters
from dit_svc.quantization import METHODS as QUANTIZATION_METHODS
from dit_svc.quantization import QuantizationReport, quantize_transformer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelOptions:
    quantization: str | None = None  # "fp8" or "int8" (applied here), or "gguf" (the loader reads the GGUF file)
    ignored_layers: tuple[str, ...] = ()
    offload: str | None = None  # "module" or "layerwise"
    offload_blocks: int = 1
    # Regional compilation (dit_svc/compile.py), applied after the options above and the parallel plan.
    compile: bool = False
    # Adapters: the directory requests name them from, and those fused in at startup.
    lora: LoraSettings = LoraSettings()

    def describe(self) -> dict[str, str]:
        """What GetClusterInfo reports of these options."""
        described = {}
        if self.quantization:
            described["quantization"] = self.quantization
            if self.ignored_layers:
                described["ignored_layers"] = ",".join(self.ignored_layers)
        if self.offload:
            described["offload"] = self.offload
            if self.offload == "layerwise":
                described["offload_blocks"] = str(self.offload_blocks)
        if self.compile:
            described["compile"] = "regional"
        if self.lora.per_request:
            described["lora_cache_bytes"] = str(self.lora.cache_bytes)
        if self.lora.fused:
            described["fused_loras"] = ",".join(f"{name}:{scale:g}" for name, scale in self.lora.fused)
        return described

    def apply(self, experts: list[nn.Module], device: torch.device, load_threads: int = 4) -> None:
        """`apply_model_options` with these options (stagekit/model_options.py TransformerOptions)."""
        apply_model_options(experts, self, device, load_threads)


def apply_model_options(
    experts: list[nn.Module], options: ModelOptions, device: torch.device, load_threads: int = 4
) -> None:
    """Fuses --lora's adapters into the first expert (the pipeline's `transformer`, where diffusers loads them),
    then quantizes (fp8, int8: GGUF experts were loaded quantized) and offloads each expert in place; with
    module-wise offload one expert is resident at a time."""
    fuse_adapters(experts[0], options.lora, load_threads)
    if options.quantization in QUANTIZATION_METHODS:
        for expert in experts:
            report: QuantizationReport = quantize_transformer(
                expert, options.quantization, list(options.ignored_layers)
            )
            logger.info("%s", report.summary())
    if options.offload:
        from dit_svc.offload import ModuleOffloader, apply_offload

        offloader = ModuleOffloader(device) if options.offload == "module" else None
        for expert in experts:
            apply_offload(expert, options.offload, device, blocks_per_group=options.offload_blocks, offloader=offloader)
