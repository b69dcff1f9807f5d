"""Weight-only quantization of the DiT's linear layers (`--quantization {fp8,int8}`, `--ignored-layers`).

Weights are stored in 8 bits with one scale per output channel; activations stay in the
model's dtype, so every matmul runs on the weight dequantized to the input's dtype. That
halves the DiT's weight memory against bf16 at a small cost in accuracy, and needs no
calibration data.

torchao does this where it is installed (`Int8WeightOnlyConfig`, `Float8WeightOnlyConfig`;
both run on CPU and CUDA, the float8 one dequantizes before its matmul). Without torchao the
two small modules below do the same arithmetic, so the flags work on every install.

`--ignored-layers` takes comma-separated linear layer names or fnmatch patterns over module
names ("proj_out,blocks.0.*,condition_embedder.*"); a pattern naming a module that holds
linear layers ("blocks.0") covers all of them. Layers that match keep their dtype.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.util
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

METHODS = ("fp8", "int8")
BACKENDS = ("auto", "torchao", "native")

# Largest magnitudes the storage types hold; each output channel's absolute maximum maps onto them.
_INT8_MAX = 127.0
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
_STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@dataclass
class QuantizationReport:
    """What `quantize_transformer` did: `stagediff info` and the logs show it."""

    method: str
    backend: str
    quantized: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    @property
    def ratio(self) -> float:
        return self.bytes_after / self.bytes_before if self.bytes_before else 1.0

    def summary(self) -> str:
        return (
            f"{self.method} ({self.backend}): {len(self.quantized)} linear layers quantized, "
            f"{len(self.skipped)} kept; parameters {self.bytes_before / 2**20:.1f} MiB -> "
            f"{self.bytes_after / 2**20:.1f} MiB ({self.ratio:.0%})"
        )


def parse_ignored_layers(text: str | None) -> list[str]:
    """'a, b.*,,c' -> ['a', 'b.*', 'c'] (the --ignored-layers value)."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def linear_layer_names(module: nn.Module) -> list[str]:
    return [name for name, child in module.named_modules() if isinstance(child, nn.Linear)]


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or name.startswith(pattern + ".")


def validate_quantization_flags(method: str | None, ignored_layers: Iterable[str], module_names: Iterable[str]) -> None:
    """Refuses an unknown method, --ignored-layers without a method, and a pattern that matches no linear layer.

    `module_names` are the model's linear layer names (`linear_layer_names`). A pattern that
    matches nothing is almost always a typo, and silently quantizing the layer the user meant
    to keep would only show up as worse images.
    """
    ignored_layers = list(ignored_layers)
    if method is None:
        if ignored_layers:
            raise ValueError(f"--ignored-layers needs --quantization; use one of {', '.join(METHODS)}")
        return
    if method not in METHODS:
        raise ValueError(f"--quantization: '{method}' is not a method; use one of {', '.join(METHODS)}")
    names = list(module_names)
    for pattern in ignored_layers:
        if not any(_matches(name, pattern) for name in names):
            examples = ", ".join(names if len(names) <= 4 else [*names[:3], "...", names[-1]])
            raise ValueError(
                f"--ignored-layers: pattern '{pattern}' matches no linear layer; layers look like: {examples}"
            )


def parameter_bytes(module: nn.Module) -> int:
    """Bytes the module's parameters occupy as stored (a torchao tensor counts its quantized data and scales)."""
    return sum(_stored_bytes(param) for param in module.parameters())


def _stored_bytes(tensor: torch.Tensor) -> int:
    if _is_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(_stored_bytes(getattr(tensor, name)) for name in names if getattr(tensor, name) is not None)
    return tensor.numel() * tensor.element_size()


def _is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    return type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__")


def weight_storage_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear layer's weight is stored in; a torchao tensor reports its compute dtype as `.dtype`."""
    weight = linear.weight
    if _is_wrapper_subclass(weight) and hasattr(weight, "qdata"):
        return weight.qdata.dtype
    return weight.dtype


@functools.cache
def torchao_available() -> bool:
    """Whether torchao's quantization API imports here. Installed is not enough: a torchao built for
    another torch fails at import, and then the native kernels must serve instead of a crash."""
    if importlib.util.find_spec("torchao") is None:
        return False
    try:
        importlib.import_module("torchao.quantization")
    except Exception as error:  # noqa: BLE001 - any import failure means: not usable here
        logger.warning(
            "torchao is installed but does not import (%s: %s); using the native kernels", type(error).__name__, error
        )
        return False
    return True


class WeightOnlyQuantizedLinear(nn.Module):
    """A linear layer whose weight is stored in int8 or float8_e4m3fn with one scale per output channel.

    The scale is kept in the layer's own dtype and registered before the weight: models read
    a submodule's dtype from its first parameter (Wan's time embedder casts the timestep to
    it), so the quantized layer answers what the original did. The scale is rounded to that
    dtype before the weight is divided by it, so the rounding costs no accuracy. Weight and
    scale are frozen parameters, not buffers, so that parameter counts, `.to()` and diffusers'
    group offloading treat them as weights.
    """

    def __init__(self, linear: nn.Linear, method: str) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.method = method
        weight = linear.weight.detach().float()
        largest = _INT8_MAX if method == "int8" else _FP8_MAX
        # The scales (one per output channel, a small vector) are computed on the CPU: CUDA divides by a
        # scalar through its reciprocal, which can move a scale by one step of its dtype, and a checkpoint
        # should quantize to the same bytes on every device.
        absmax = weight.abs().amax(dim=1).cpu()
        scale = (absmax / largest).to(linear.weight.dtype)
        scale = scale.clamp(min=torch.finfo(scale.dtype).tiny).to(weight.device)
        scaled = (weight / scale.float()[:, None]).clamp(-largest, largest)
        qweight = torch.round(scaled).to(torch.int8) if method == "int8" else scaled.to(torch.float8_e4m3fn)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.weight = nn.Parameter(qweight, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale.float()[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}"


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: '{backend}' is not a backend; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "torchao" if torchao_available() else "native"
    if backend == "torchao" and not torchao_available():
        raise ValueError("backend 'torchao' needs the torchao package, importable with this torch")
    return backend


def _quantize_torchao(module: nn.Module, method: str, selected: set[str]) -> None:
    import torchao.quantization as ao

    config = ao.Int8WeightOnlyConfig() if method == "int8" else ao.Float8WeightOnlyConfig()
    ao.quantize_(module, config, filter_fn=lambda child, fqn: isinstance(child, nn.Linear) and fqn in selected)


def _quantize_native(module: nn.Module, method: str, selected: set[str]) -> None:
    for name in selected:
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        linear = getattr(parent, child_name)
        setattr(parent, child_name, WeightOnlyQuantizedLinear(linear, method))


@torch.no_grad()
def quantize_transformer(
    module: nn.Module, method: str, ignored_layers: Iterable[str] = (), backend: str = "auto"
) -> QuantizationReport:
    """Quantizes every nn.Linear of `module` in place except those `ignored_layers` match.

    Run it after the model is on its device, so the quantized weights are made there.
    backend: "torchao" (needs the package), "native" (the module above) or "auto" (torchao when installed).
    """
    ignored_layers = list(ignored_layers)
    names = linear_layer_names(module)
    validate_quantization_flags(method, ignored_layers, names)
    backend = _resolve_backend(backend)
    report = QuantizationReport(method=method, backend=backend, bytes_before=parameter_bytes(module))
    for name in names:
        (report.skipped if any(_matches(name, p) for p in ignored_layers) else report.quantized).append(name)
    if backend == "torchao":
        _quantize_torchao(module, method, set(report.quantized))
    else:
        _quantize_native(module, method, set(report.quantized))
    report.bytes_after = parameter_bytes(module)
    logger.info("quantization %s", report.summary())
    return report


def expected_storage_dtype(method: str) -> torch.dtype:
    return _STORAGE_DTYPES[method]
