"""StageDiff: diffusion models served as a cluster of gRPC stage services."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    # The client classes (stagediff.client).
    "AsyncClient",
    "Client",
    "GenerationResult",
    "RetryPolicy",
    # The errors its calls raise (stagediff.errors).
    "StageDiffError",
    "InvalidArgument",
    "AuthenticationError",
    "PermissionDenied",
    "NotFound",
    "RateLimitError",
    "Unavailable",
    "ConnectionFailed",
    "InvalidEndpoint",
    "DeadlineExceeded",
    "Cancelled",
    "FailedPrecondition",
    "InternalError",
    "__version__",
]
_CLIENT_NAMES = frozenset(__all__[:4])
_ERROR_NAMES = frozenset(__all__[4:-1])

if TYPE_CHECKING:
    from stagediff.client import AsyncClient, Client, GenerationResult, RetryPolicy
    from stagediff.errors import (
        AuthenticationError,
        Cancelled,
        ConnectionFailed,
        DeadlineExceeded,
        FailedPrecondition,
        InternalError,
        InvalidArgument,
        InvalidEndpoint,
        NotFound,
        PermissionDenied,
        RateLimitError,
        StageDiffError,
        Unavailable,
    )


def __getattr__(name: str) -> Any:
    """The client classes and errors, imported on first use: servers import `stagediff.v1`, `stagediff.tensor_codec`
    and `stagediff.status_details` without loading the client and its event-loop machinery."""
    if name in _CLIENT_NAMES:
        from stagediff import client

        return getattr(client, name)
    if name in _ERROR_NAMES:
        from stagediff import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'stagediff' has no attribute {name!r}")
