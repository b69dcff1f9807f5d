"""StageDiff: diffusion models served as a cluster of gRPC stage services."""

__version__ = "0.1.0"

from stagediff.client import AsyncClient, Client, GenerationResult, StageDiffError  # noqa: E402

__all__ = ["AsyncClient", "Client", "GenerationResult", "StageDiffError", "__version__"]
