"""Which LoRA adapters a tenant may use, checked at the door before any stage runs.

The DiT lists the adapters of its --lora-dir in its ModelLimits (`loras`): "NAME" for one at the top of the
directory, "TENANT/NAME" for one in a tenant's subdirectory. A tenant may use
- a top-level adapter whose name matches one of the names or shell patterns (fnmatch) of its `loras` in the
  tenants file (none by default; the open tenant of a cluster without a tenants file may use all of them);
- its own private adapters ("<its name>/..."), without listing them.
Another tenant's private adapter is never usable, whatever the patterns say, and is answered as absent
(NOT_FOUND), so that a tenant cannot learn the names of another's adapters. A listed adapter it may not use is
PERMISSION_DENIED; one the DiT does not list is NOT_FOUND. ListModels shows each tenant only what it may use.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

import grpc

from services.orchestrator.tenants import Tenant, TenantError
from services.validation import lora_owner
from stagediff.v1 import stages_pb2


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
    """Raises LoraNotFound or LoraNotAllowed for the first adapter of the request the tenant cannot use."""
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
