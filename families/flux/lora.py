"""FLUX.1's adapter loader: FluxPipeline's, which also reads BFL's own names with PEFT's lora_A/lora_B.

FluxPipeline's `lora_state_dict` converts kohya's, XLabs' and ComfyUI's files (ComfyUI's keep BFL's module names,
"diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight", with an alpha per layer), and BFL's control
adapters; it leaves the plain BFL layout, the same module names with PEFT's "lora_A"/"lora_B" and no alpha,
unconverted (diffusers 0.42.1). That layout is ComfyUI's with other part names and an implied alpha equal to the
rank (PEFT's scale 1), so `FluxLoraLoader` renames such a file into ComfyUI's layout and hands it to
FluxPipeline's own converter; every other file goes to that converter unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.loaders import FluxLoraLoaderMixin

# ComfyUI's prefix of BFL's module names.
_PREFIX = "diffusion_model."
# BFL's block lists: a key of a BFL-layout adapter names one of them.
_BFL_BLOCKS = ("double_blocks.", "single_blocks.")
# Keys of BFL's control adapters, which FluxPipeline's loader converts itself.
_CONTROL = "query_norm.scale"


def is_bfl_peft(state: dict[str, torch.Tensor]) -> bool:
    """Whether `state` is BFL's module names with PEFT's lora_A/lora_B (and not a control adapter)."""
    names = [key.removeprefix(_PREFIX) for key in state]
    return (
        any(name.startswith(_BFL_BLOCKS) and name.endswith(".lora_A.weight") for name in names)
        and not any(_CONTROL in name for name in names)
        and not any(".lora_down." in name for name in names)
    )


def bfl_peft_as_comfyui(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same adapter in ComfyUI's layout: each layer's lora_A/lora_B as lora_down/lora_up, and its alpha the
    rank (lora_A's rows), which makes the converter's scale alpha / rank the 1 PEFT applies."""
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name = _PREFIX + key.removeprefix(_PREFIX)
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight")
            renamed[f"{module}.lora_down.weight"] = tensor
            renamed[f"{module}.alpha"] = torch.tensor(float(tensor.shape[0]))
        elif name.endswith(".lora_B.weight"):
            renamed[name.removesuffix(".lora_B.weight") + ".lora_up.weight"] = tensor
        else:
            renamed[name] = tensor
    return renamed


class FluxLoraLoader(FluxLoraLoaderMixin):
    """FluxPipeline's adapter loader (`lora_state_dict`, `load_lora_into_transformer`), reading BFL's lora_A/lora_B
    files too (the module docstring says how)."""

    # The pipeline whose loader this extends, as adapter errors name it.
    pipeline_name = "FluxPipeline"

    @classmethod
    def lora_state_dict(
        cls, pretrained_model_name_or_path_or_dict: Any, return_alphas: bool = False, **kwargs: Any
    ) -> Any:
        state = pretrained_model_name_or_path_or_dict
        if isinstance(state, dict) and is_bfl_peft(state):
            state = bfl_peft_as_comfyui(state)
        return super().lora_state_dict(state, return_alphas=return_alphas, **kwargs)
