"""The launch id: how whoever started a server tells that server from another one answering on its port.

`stagediff up` starts each service with a new random id in its environment (LAUNCH_ID_ENV) and reports the
cluster ready only once each port answers with that id: a gRPC server sends it in the initial metadata of its
grpc.health.v1 Check answers (LaunchIdInterceptor), the HTTP gateway in its GET /readyz body. Only the process
it was given to knows it before it answers, so an answer that carries it comes from that process. It is no
secret: it is new for every process started, and says nothing about the cluster.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

LAUNCH_ID_ENV = "STAGEDIFF_LAUNCH_ID"
LAUNCH_ID_METADATA = "stagediff-launch-id"
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"


def launch_id() -> str:
    """This process's launch id, or "" when whoever started it gave none."""
    return os.environ.get(LAUNCH_ID_ENV, "")


class LaunchIdInterceptor(grpc.aio.ServerInterceptor):
    """Sends this process's launch id in the initial metadata of every grpc.health.v1 Check answer."""

    def __init__(self, value: str) -> None:
        self.value = value

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        # None for a method no servicer has (grpc-stubs leave None out).
        handler: grpc.RpcMethodHandler | None = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != HEALTH_CHECK_METHOD or not handler.unary_unary:
            return handler  # type: ignore[return-value]  # grpc takes None: no such method
        # grpc-stubs type the behaviours as sync functions; a grpc.aio server's are coroutines.
        inner: Callable[..., Any] = handler.unary_unary

        async def check(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.send_initial_metadata(((LAUNCH_ID_METADATA, self.value),))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(check, handler.request_deserializer, handler.response_serializer)
