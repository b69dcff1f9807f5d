"""An echo service of every call kind behind the tenant-key and cluster-secret interceptors, on a real aio
server, with the keys, metadata and call helpers the authentication tests use."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from services.orchestrator.tenant_auth import current_tenant
from services.orchestrator.tenants import TenantRegistry, hash_api_key

SERVICE = "test.Echo"
KEY_ACME = "sd_acme-0123456789abcdefghijklmnopqrstuvwxyzABCDEFG"
KEY_BETA = "sd_beta-0123456789abcdefghijklmnopqrstuvwxyzABCDEFG"
SECRET = "cluster-secret-0123456789abcdefghijklmnop"


def registry() -> TenantRegistry:
    return TenantRegistry.from_dict(
        {
            "tenants": [
                {"name": "acme", "api_keys": [hash_api_key(KEY_ACME)]},
                {"name": "beta", "api_keys": [hash_api_key(KEY_BETA)]},
            ]
        }
    )


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


class Echo:
    """A service of every call kind that answers with the caller's tenant ('-' when none is set)."""

    def __init__(self) -> None:
        self.calls = 0

    def _who(self) -> bytes:
        self.calls += 1
        try:
            return current_tenant().name.encode()
        except LookupError:
            return b"-"

    def handler(self) -> grpc.GenericRpcHandler:
        async def unary(request, context):
            return self._who()

        async def server_stream(request, context):
            who = self._who()
            yield who
            await asyncio.sleep(0)  # the tenant stays set across the generator's suspensions
            yield current_tenant().name.encode() if who != b"-" else who

        async def write_stream(request, context):
            await context.write(self._who())

        async def client_stream(requests, context):
            count = 0
            async for _ in requests:
                count += 1
            return self._who() + b"/%d" % count

        async def bidi_stream(requests, context):
            async for request in requests:
                yield self._who() + b":" + request

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
                "WriteStream": grpc.unary_stream_rpc_method_handler(write_stream),
                "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
                "BidiStream": grpc.stream_stream_rpc_method_handler(bidi_stream),
            },
        )


async def call(channel: grpc.aio.Channel, kind: str, metadata=(), refused: bool = False) -> list[bytes]:
    """Calls `kind` on the echo service; returns what came back as a list.

    With `refused`, a request stream sends nothing until the call has ended: a
    grpc aio client that is still writing when the server ends the call may
    report INTERNAL instead of the server's status (grpc/grpc#36066), and a
    refusal depends only on the headers.
    """
    method = f"/{SERVICE}/{kind}"
    if kind == "Unary":
        return [await channel.unary_unary(method)(b"x", metadata=metadata, timeout=10)]
    if kind in ("ServerStream", "WriteStream"):
        return [r async for r in channel.unary_stream(method)(b"x", metadata=metadata, timeout=10)]
    ended = asyncio.Event()

    async def requests():
        if refused:
            await ended.wait()
            return
        yield b"a"
        yield b"b"

    try:
        if kind == "ClientStream":
            return [await channel.stream_unary(method)(requests(), metadata=metadata, timeout=10)]
        return [r async for r in channel.stream_stream(method)(requests(), metadata=metadata, timeout=10)]
    finally:
        ended.set()


@contextlib.asynccontextmanager
async def echo_server(
    interceptor: grpc.aio.ServerInterceptor | list[grpc.aio.ServerInterceptor] | None,
    echo: Echo,
    credentials: grpc.ServerCredentials | None = None,
) -> AsyncIterator[str]:
    """A real aio server with the echo service, health and reflection on a free port."""
    interceptors = interceptor if isinstance(interceptor, list) else [interceptor] if interceptor else None
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers((echo.handler(),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([SERVICE, "grpc.health.v1.Health", reflection.SERVICE_NAME], server)
    address = "127.0.0.1:0"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def run(scenario: Callable[[], Awaitable]):
    return asyncio.run(scenario())
