"""The tenants a server knows, and the checks made on their behalf: who a call is, whether its tenant's
rate allows it, whether its tenant may use the model it names, and whether a request stays within its tenant's
size limits for that model.

Without a tenants file the registry is open: one tenant, "default", that every caller is, with no key, an
operator's rights (admin) and only the default quotas on what a job produces (max_output_frames,
max_output_pixels) and on open WatchJob streams (for local use); it may use every model and every public LoRA
adapter.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.orchestrator.tenants.errors import AuthenticationError, LimitExceeded, ModelNotAllowed, RateLimited
from services.orchestrator.tenants.keys import bearer_token, hash_api_key
from services.orchestrator.tenants.rate_limit import Clock, RateLimiter
from services.orchestrator.tenants.schema import (
    DEFAULT_TENANT_NAME,
    PriorityClass,
    Tenant,
    parse_tenants,
    read_tenants_file,
)


class SizedRequest(Protocol):
    """What check_request_limits reads: a GenerateRequest with every default filled in."""

    model: str
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    interpolation: Any  # InterpolationParams: enable, exp


@dataclass(frozen=True)
class TenantScheduling:
    """What scheduling reads of a tenant: its priority class, its weight inside the class, and whether its jobs may
    yield their DiT slot to a waiting job of a higher class (services/orchestrator/preemption.py)."""

    priority: PriorityClass = PriorityClass.NORMAL
    weight: float = 1.0
    preemptible: bool = True


def visible_models(tenant: Tenant, models: Iterable[str]) -> list[str]:
    """The ids of `models` the tenant may use, in their order (what ListModels shows it)."""
    return [model for model in models if tenant.may_use(model)]


def _interp_exp(request: SizedRequest) -> int:
    interpolation = request.interpolation
    return interpolation.exp if interpolation.enable and interpolation.exp > 0 else 0


def output_frames(request: SizedRequest) -> int:
    """Frames the job produces: the requested ones, and 2**exp - 1 more between each pair when interpolating."""
    return (request.num_frames - 1) * 2 ** _interp_exp(request) + 1


class TenantRegistry:
    """The tenants a server knows, and the per-request checks made on their behalf."""

    def __init__(
        self, tenants: Sequence[Tenant], *, open_tenant: Tenant | None = None, clock: Clock = time.monotonic
    ) -> None:
        """Prefer `from_file` or `open`. With `open_tenant`, every caller is that tenant."""
        self.tenants: Mapping[str, Tenant] = {tenant.name: tenant for tenant in tenants}
        self.open_tenant = open_tenant
        self.rate_limiter = RateLimiter(clock)
        self._by_digest = {key: tenant for tenant in tenants for key in tenant.api_keys}

    @classmethod
    def open(cls, *, clock: Clock = time.monotonic) -> TenantRegistry:
        """The registry without a tenants file: one tenant, 'default', no key needed, admin, default quotas."""
        tenant = Tenant(name=DEFAULT_TENANT_NAME, admin=True, loras=("*",))
        return cls([tenant], open_tenant=tenant, clock=clock)

    @classmethod
    def from_file(cls, path: str | Path, *, clock: Clock = time.monotonic) -> TenantRegistry:
        """Reads and validates a tenants YAML file; raises TenantConfigError naming the file and field."""
        path = Path(path)
        return cls.from_dict(read_tenants_file(path), source=str(path), clock=clock)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "tenants", clock: Clock = time.monotonic) -> TenantRegistry:
        """Validates already-parsed tenants data (the YAML file's content)."""
        return cls(parse_tenants(data, source), clock=clock)

    @property
    def is_open(self) -> bool:
        return self.open_tenant is not None

    def scheduling(self, name: str) -> TenantScheduling:
        """The scheduling properties of the tenant named `name`; a name the registry does not know (the tenant of a
        job recovered after it left the file) has the defaults: normal class, weight 1, preemptible."""
        tenant = self.tenants.get(name)
        if tenant is None:
            return TenantScheduling()
        return TenantScheduling(tenant.priority, tenant.weight, tenant.preemptible)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The tenant whose key the call presents; raises AuthenticationError (never repeating the key)."""
        if self.open_tenant is not None:
            return self.open_tenant
        key = bearer_token(metadata)
        tenant = self._by_digest.get(hash_api_key(key))
        if tenant is None:
            raise AuthenticationError("invalid API key: no tenant has this key (it may have been revoked)")
        return tenant

    def check_model(self, tenant: Tenant, model: str) -> None:
        """Raises ModelNotAllowed when the tenant's `models` do not list `model` (an id or a pattern matching it).

        The message names the tenant, the model and the tenant's own patterns, nothing of another tenant's.
        """
        if tenant.may_use(model):
            return
        raise ModelNotAllowed(
            tenant.name,
            model,
            f"model: tenant '{tenant.name}' may not use model '{model}'; it may use {', '.join(tenant.models)} "
            "(ListModels shows the models it may use)",
        )

    def check_request_limits(self, tenant: Tenant, request: SizedRequest) -> None:
        """Raises LimitExceeded when a request exceeds its tenant's size, frame or step limits for its model
        (`Tenant.quotas_for`: the tenant's quotas, or its model_quotas for that model where they are set).

        Call it with the request completed with the model's defaults, so that an
        unset field is checked at the value that would really run.
        """
        quotas = tenant.quotas_for(request.model)
        per_model = tenant.model_quotas.get(request.model)

        def refuse(field: str, quota: str, value: int, limit: int, what: str) -> LimitExceeded:
            model = request.model if per_model is not None and quota in per_model.model_fields_set else ""
            scope = f" for model '{model}'" if model else ""
            return LimitExceeded(
                tenant.name,
                field,
                value,
                limit,
                f"{field}: {what} exceeds tenant '{tenant.name}' limit of {limit}{scope}",
                model=model,
            )

        checks = (
            ("height", "max_height", request.height, quotas.max_height),
            ("width", "max_width", request.width, quotas.max_width),
            ("num_frames", "max_frames", request.num_frames, quotas.max_frames),
            ("num_inference_steps", "max_steps", request.num_inference_steps, quotas.max_steps),
        )
        for field, quota, value, limit in checks:
            if limit is not None and value > limit:
                raise refuse(field, quota, value, limit, str(value))
        pixels = request.height * request.width
        if quotas.max_pixels is not None and pixels > quotas.max_pixels:
            raise refuse(
                "height*width",
                "max_pixels",
                pixels,
                quotas.max_pixels,
                f"{request.height}x{request.width} = {pixels} pixels",
            )
        frames_out = output_frames(request)
        if quotas.max_output_frames is not None and frames_out > quotas.max_output_frames:
            raise refuse(
                "output frames",
                "max_output_frames",
                frames_out,
                quotas.max_output_frames,
                f"{frames_out} ({request.num_frames} frames, interpolation.exp {_interp_exp(request)})",
            )
        pixels_out = frames_out * pixels
        if quotas.max_output_pixels is not None and pixels_out > quotas.max_output_pixels:
            raise refuse(
                "output pixels",
                "max_output_pixels",
                pixels_out,
                quotas.max_output_pixels,
                f"{frames_out} frames of {request.height}x{request.width} = {pixels_out} pixels",
            )

    def check_rate(self, tenant: Tenant) -> None:
        """Takes one request from the tenant's rate limit; raises RateLimited with the wait when spent."""
        wait = self.rate_limiter.acquire(tenant)
        if wait > 0.0:
            rate = tenant.quotas.requests_per_minute
            raise RateLimited(
                tenant.name,
                wait,
                f"tenant '{tenant.name}' is over its limit of {rate:g} requests per minute; retry in {wait:.1f} s",
            )
