"""Rich error details: RESOURCE_EXHAUSTED that tells the client when to retry.

A refusal for load (rate limit, full queue) is only useful if the client knows
how long to wait. gRPC's convention for that is a google.rpc.Status carrying a
google.rpc.RetryInfo in its details, sent in the `grpc-status-details-bin`
trailer next to the ordinary code and message, so that clients unaware of it
still see a plain RESOURCE_EXHAUSTED with a readable message.

Server side:  `await abort_with_retry(context, message, retry_after_s)`
Client side:  `retry_after(error)` on a grpc.RpcError or grpc.aio.AioRpcError.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NoReturn, cast

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

DETAILS_METADATA_KEY = "grpc-status-details-bin"


def retry_status(
    message: str, retry_after_s: float, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED
) -> grpc.Status:
    """A grpc.Status with `code`, `message` and a RetryInfo of `retry_after_s` seconds in its details."""
    if not math.isfinite(retry_after_s) or retry_after_s < 0:
        raise ValueError(f"retry_after_s: {retry_after_s} is not a delay; use a finite number of seconds >= 0")
    if code == grpc.StatusCode.OK:
        raise ValueError("code: OK carries no retry advice; use an error code")
    delay = Duration()
    delay.FromNanoseconds(math.ceil(retry_after_s * 1e9))
    info = error_details_pb2.RetryInfo(retry_delay=delay)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    return rpc_status.to_status(status)


async def abort_with_retry(
    context: grpc.aio.ServicerContext[Any, Any],
    message: str,
    retry_after_s: float,
    code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
) -> NoReturn:
    """Ends the call with `code` (RESOURCE_EXHAUSTED by default) and a RetryInfo; never returns."""
    # grpc-stubs omit grpc.aio.ServicerContext.abort_with_status, which grpc has.
    await context.abort_with_status(retry_status(message, retry_after_s, code))  # type: ignore[attr-defined]
    raise AssertionError("abort_with_status returned")  # grpc always raises; this keeps NoReturn honest


def rich_status(error: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status a failed call carried in its trailer, or None when it carried none.

    Works for grpc.RpcError from a sync call and grpc.aio.AioRpcError alike:
    both give their trailing metadata without awaiting.
    """
    # grpc gives (key, value) pairs; grpc-stubs type a metadatum as an object with attributes.
    trailing = cast(Iterable[tuple[str, Any]], error.trailing_metadata() if hasattr(error, "trailing_metadata") else ())
    for key, value in trailing or ():
        if key == DETAILS_METADATA_KEY:
            status = status_pb2.Status.FromString(value)
            # A status whose code disagrees with the call's is not about this call.
            if status.code != error.code().value[0] or status.code == code_pb2.OK:
                return None
            return status
    return None


def retry_after(error: grpc.RpcError) -> float | None:
    """Seconds the server asked the client to wait before retrying, or None when it gave no RetryInfo."""
    status = rich_status(error)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return float(info.retry_delay.ToNanoseconds() / 1e9)
    return None
