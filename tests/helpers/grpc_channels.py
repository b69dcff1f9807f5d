"""Channels to stage services that carry the cluster secret, and the check of a failed call's status.

Every stage a test starts (through LocalCluster or directly) demands CLUSTER_SECRET, as a deployed cluster's
stages demand theirs; tests/conftest.py puts it in the environment before any test runs, and tests that call
a stage directly open their channel with `stage_channel`.
"""

from __future__ import annotations

import grpc

from services.auth import CLUSTER_SECRET_METADATA_KEY

CLUSTER_SECRET = "test-cluster-secret"


class _ClusterSecret(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the cluster secret to every call of a blocking channel."""

    def _with_secret(self, details):
        metadata = [*(details.metadata or ()), (CLUSTER_SECRET_METADATA_KEY, CLUSTER_SECRET)]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_secret(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_secret(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_secret(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_secret(details), requests)


def stage_channel(endpoint: str) -> grpc.Channel:
    """A blocking channel to a stage service that sends the cluster secret with every call."""
    return grpc.intercept_channel(grpc.insecure_channel(endpoint), _ClusterSecret())


def assert_status(error: grpc.RpcError, code: grpc.StatusCode, *words: str) -> None:
    """The call failed with `code` and a message that names each word."""
    assert error.code() == code, f"expected {code}, got {error.code()}: {error.details()}"
    for word in words:
        assert word in (error.details() or ""), f"'{word}' not named in: {error.details()}"
