"""Building a model from its config without allocating its parameters, and the dtype each weight ends in.

Parameters are created on the meta device (no allocation, no random init) while buffers are created for real
by the module's own `__init__`, so buffers that are not saved weights (RoPE tables, `persistent=False`) hold
exactly the values `from_pretrained` computes. The default dtype is the requested one while building, as in
both libraries. Which weights stay fp32 follows the library's own rule unless the caller overrides it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from stagekit.weights.keys import TensorEntry


def library_of(model_class: type[nn.Module]) -> str:
    from diffusers import ModelMixin

    if issubclass(model_class, ModelMixin):
        return "diffusers"
    from transformers import PreTrainedModel

    if issubclass(model_class, PreTrainedModel):
        return "transformers"
    raise TypeError(f"{model_class.__name__} is neither a diffusers ModelMixin nor a transformers PreTrainedModel")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Both libraries build the model under the requested default dtype, which decides buffer dtypes."""
    previous = torch.get_default_dtype()
    if dtype.is_floating_point and dtype.itemsize >= 2:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_empty(model_class: type[nn.Module], directory: Path, library: str, dtype: torch.dtype) -> nn.Module:
    """The model with parameters on the meta device and buffers computed for real by `__init__`."""
    from accelerate import init_empty_weights

    if library == "diffusers":
        from diffusers.models.modeling_utils import no_init_weights

        config = model_class.load_config(directory)
        with no_init_weights(), init_empty_weights(include_buffers=False), _default_dtype(dtype):
            return model_class.from_config(config)

    config = model_class.config_class.from_pretrained(directory)
    with init_empty_weights(include_buffers=False), _default_dtype(dtype):
        model = model_class(config)
    return model


def tied_keys(model: nn.Module) -> dict[str, str]:
    """Model key -> the key it is tied to, for weights saved once and shared (transformers' tied embeddings)."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            tied.setdefault(name, first_name[id(param)])
        else:
            first_name[id(param)] = name
    return tied


def fp32_matcher(
    model: nn.Module | type[nn.Module], library: str, dtype: torch.dtype, keep_in_fp32: Sequence[str] | None
) -> Callable[[str], bool]:
    """Which keys stay fp32, by the same rule as the library's from_pretrained unless overridden."""
    if keep_in_fp32 is not None:
        names = set(keep_in_fp32)
        return lambda key: bool(names.intersection(key.split(".")))
    if library == "diffusers":
        names = set(getattr(model, "_keep_in_fp32_modules", None) or [])
        return lambda key: bool(names.intersection(key.split(".")))

    plan = model._get_dtype_plan(dtype)
    if not plan:
        return lambda key: False
    from transformers.core_model_loading import build_glob_alternation

    pattern, group_to_glob, _ = build_glob_alternation(list(plan))

    def match(key: str) -> bool:
        found = pattern.search(key)
        return found is not None and plan[group_to_glob[found.lastgroup]] == torch.float32

    return match


def target_dtype(
    dtype: torch.dtype,
    keep_fp32: Callable[[str], bool],
    meta_state: dict[str, torch.Tensor] | None,
    entry: TensorEntry,
) -> torch.dtype:
    """The dtype a checkpoint tensor ends in, by the rule of the model's library.

    Only floating-point tensors are cast. transformers (`meta_state` given) also keeps the dtype of a
    tensor the class creates in a dtype of its own; diffusers casts every other one to `dtype`.
    """
    if not entry.dtype.is_floating_point:
        return entry.dtype
    if keep_fp32(entry.key):
        return torch.float32
    if meta_state is not None and dtype != meta_state[entry.key].dtype:
        return meta_state[entry.key].dtype
    return dtype
