"""Which LoRA adapters a tenant may use, checked at the door before any stage runs.

The DiT lists the adapters of its --lora-dir in its ModelLimits (`loras`): "NAME" for one at the top of the
directory, "TENANT/NAME" for one in a tenant's subdirectory. A tenant may use
- a top-level adapter whose name matches one of the names or shell patterns (fnmatch) of its `loras` in the
  tenants file (none by default; the open tenant of a cluster without a tenants file may use all of them);
- its own private adapters ("<its name>/..."), without listing them.
Another tenant's private adapter is never usable, whatever the patterns say, and is answered as absent
(NOT_FOUND), so that a tenant cannot learn the names of another's adapters. A listed adapter it may not use is
PERMISSION_DENIED; one the DiT does not list is NOT_FOUND. ListModels shows each tenant only what it may use.
Adapters that together take more than the DiT keeps loaded (ModelLimits.lora_cache_bytes, against each listed
adapter's load_bytes) can never run: INVALID_ARGUMENT, before any stage runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

import grpc

from services.orchestrator.tenants import Tenant, TenantError
from services.validation import lora_owner
from stagediff.v1 import stages_pb2
from stagekit.errors import RequestError


class LoraNotFound(TenantError):
    """An adapter the DiT does not serve, or another tenant's private one (NOT_FOUND)."""

    code = grpc.StatusCode.NOT_FOUND


class LoraNotAllowed(TenantError):
    """An adapter the tenants file does not let the tenant use (PERMISSION_DENIED)."""

    code = grpc.StatusCode.PERMISSION_DENIED


def may_use(tenant: Tenant, name: str) -> bool:
    owner = lora_owner(name)
    if owner is not None:
        return owner == tenant.name
    return any(fnmatchcase(name, pattern) for pattern in tenant.loras)


def visible(tenant: Tenant, listed: Iterable[stages_pb2.LoraInfo]) -> list[stages_pb2.LoraInfo]:
    """The adapters of a model's listing that the tenant may use (what ListModels shows it)."""
    return [info for info in listed if may_use(tenant, info.name)]


def check_loras(tenant: Tenant, loras: Iterable[stages_pb2.LoraAdapter], limits: stages_pb2.ModelLimits) -> None:
    """Raises LoraNotFound or LoraNotAllowed for the first adapter of the request the tenant cannot use, or
    RequestError when its adapters together do not fit the DiT's adapter cache."""
    loras = list(loras)
    _check_each(tenant, loras, limits)
    _check_fit(loras, limits)


def _check_fit(loras: list[stages_pb2.LoraAdapter], limits: stages_pb2.ModelLimits) -> None:
    """Raises RequestError when the adapters (each listed) take more than the DiT's lora_cache_bytes loaded."""
    if not loras or not limits.lora_cache_bytes:
        return
    sizes = {info.name: info.load_bytes for info in limits.loras}
    needed = sum(sizes[name] for name in dict.fromkeys(lora.name for lora in loras))
    if needed > limits.lora_cache_bytes:
        raise RequestError(
            f"loras: {', '.join(lora.name for lora in loras)} take {needed} bytes loaded; this model holds at most "
            f"{limits.lora_cache_bytes} bytes of adapters at once (ListModels shows each adapter's load_bytes and "
            "the model's lora_cache_bytes): name fewer or smaller adapters"
        )


def _check_each(tenant: Tenant, loras: list[stages_pb2.LoraAdapter], limits: stages_pb2.ModelLimits) -> None:
    listed = {info.name for info in limits.loras}
    for index, lora in enumerate(loras):
        field = f"loras[{index}].name"
        owner = lora_owner(lora.name)
        if lora.name not in listed or (owner is not None and owner != tenant.name):
            served = "it serves none per request" if not limits.max_loras else "ListModels shows those you may use"
            raise LoraNotFound(f"{field}: no adapter '{lora.name}' on this model ({served})")
        if not may_use(tenant, lora.name):
            raise LoraNotAllowed(
                f"{field}: tenant '{tenant.name}' may not use adapter '{lora.name}' (the tenants file lists the "
                "adapters each tenant may use)"
            )
