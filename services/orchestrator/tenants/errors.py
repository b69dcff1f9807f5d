"""Calls refused on a tenant's account, each carrying the status code a servicer answers with (`code`).

UNAUTHENTICATED for a missing or wrong key, PERMISSION_DENIED for a request beyond one of its tenant's size
limits or for a model the tenant may not use (retrying cannot help, though another tenant could make it), and
RESOURCE_EXHAUSTED with a retry delay for the rate limit (waiting helps).
"""

from __future__ import annotations

import grpc


class TenantError(Exception):
    """A call refused on the tenant's account; `code` is the status to answer with."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class AuthenticationError(TenantError):
    """No key, a malformed authorization header, or a key no tenant has (UNAUTHENTICATED)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class LimitExceeded(TenantError):
    """A request beyond one of its tenant's size limits (PERMISSION_DENIED; retrying cannot help).

    `model` is the model whose quota it is (the tenant's model_quotas), "" for the tenant's own quotas.
    """

    code = grpc.StatusCode.PERMISSION_DENIED

    def __init__(self, tenant: str, field: str, value: int, limit: int, message: str, *, model: str = "") -> None:
        super().__init__(message)
        self.tenant = tenant
        self.field = field
        self.value = value
        self.limit = limit
        self.model = model


class ModelNotAllowed(TenantError):
    """A request for a model its tenant's `models` do not list (PERMISSION_DENIED; retrying cannot help)."""

    code = grpc.StatusCode.PERMISSION_DENIED

    def __init__(self, tenant: str, model: str, message: str) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.model = model


class RateLimited(TenantError):
    """The tenant's requests-per-minute are spent (RESOURCE_EXHAUSTED); `retry_after` is in seconds."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, tenant: str, retry_after: float, message: str) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.retry_after = retry_after
