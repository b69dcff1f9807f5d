"""StageDiff: diffusion models served as a cluster of gRPC stage services."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "GenerationResult", "StageDiffError", "__version__"]

if TYPE_CHECKING:
    from stagediff.client import AsyncClient, Client, GenerationResult, StageDiffError


def __getattr__(name: str) -> Any:
    """The client classes, imported on first use: servers import `stagediff.v1`, `stagediff.tensor_codec` and
    `stagediff.status_details` without loading the client and its event-loop machinery."""
    if name in ("AsyncClient", "Client", "GenerationResult", "StageDiffError"):
        from stagediff import client

        return getattr(client, name)
    raise AttributeError(f"module 'stagediff' has no attribute {name!r}")
