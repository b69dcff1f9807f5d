"""After the tensors are in: re-tying shared weights, placing buffers, and checking nothing is left empty."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from stagekit.weights.keys import listed_keys


def set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    """Puts `value` at `key`: as a parameter where the module has one of that name, else as a buffer."""
    path, _, name = key.rpartition(".")
    module = model.get_submodule(path)
    if name in module._parameters:
        module._parameters[name] = value if isinstance(value, nn.Parameter) else nn.Parameter(value)
    else:
        module._buffers[name] = value


def finish(
    model: nn.Module, library: str, device: torch.device, directory: Path, tied: dict[str, str], wanted: set[str]
) -> None:
    """Re-tie shared weights, move the buffers `__init__` made onto `device`, and check nothing is left empty."""
    with torch.no_grad():
        if library == "transformers":
            model.tie_weights()
        for key, source in tied.items():
            value = model.get_parameter(source)
            if not value.is_meta:
                set_tensor(model, key, value)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and not buffer.is_meta and buffer.device != device:
                    module._buffers[name] = buffer.to(device)

    left = [key for key, value in model.state_dict(keep_vars=True).items() if value.is_meta and key in wanted]
    if left:
        raise ValueError(f"cannot load {type(model).__name__} from {directory}: not filled: {listed_keys(left)}")
    if library == "diffusers":
        model.register_to_config(_name_or_path=str(directory))
    model.eval()
