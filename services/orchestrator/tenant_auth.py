"""Who calls the public port: every call but health and reflection presents a tenant's API key.

`TenantAuthInterceptor` checks the key (`authorization: Bearer <key>`) against the
tenant registry; a call without one, or with a wrong one, gets UNAUTHENTICATED before
its handler runs. The handler reads the caller with `current_tenant()`.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, cast

import grpc

from services.auth import (
    HEALTH_SERVICE,
    REFLECTION_SERVICES,
    RateLimitedLog,
    install_metadata_encoding_filter,
    refusing_handler,
    service_of,
)
from services.orchestrator.tenants import AuthenticationError, Tenant, TenantRegistry

logger = logging.getLogger(__name__)

_tenant: contextvars.ContextVar[Tenant] = contextvars.ContextVar("stagediff_tenant")


def current_tenant() -> Tenant:
    """The tenant of the call being handled, set by TenantAuthInterceptor.

    Each call runs in its own asyncio task, so the value is the caller's for
    the whole handler, including inside the async generators of streaming RPCs
    and in tasks the handler creates (they copy the context). Raises
    LookupError outside a call that went through the interceptor.
    """
    return _tenant.get()


def _with_tenant(handler: grpc.RpcMethodHandler, tenant: Tenant) -> grpc.RpcMethodHandler:
    """`handler`, with `current_tenant()` set to `tenant` while it runs."""
    deserializer, serializer = handler.request_deserializer, handler.response_serializer
    # grpc-stubs type the behaviours as sync functions; a grpc.aio server's are coroutines and async generators.
    if not handler.response_streaming:
        inner = cast(Callable[..., Awaitable[Any]], handler.stream_unary or handler.unary_unary)

        async def unary_response(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            _tenant.set(tenant)
            return await inner(request_or_iterator, context)

        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(unary_response, deserializer, serializer)
        return grpc.unary_unary_rpc_method_handler(unary_response, deserializer, serializer)

    inner_stream = cast(Callable[..., Any], handler.stream_stream or handler.unary_stream)

    async def streaming_response(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        _tenant.set(tenant)
        result = inner_stream(request_or_iterator, context)
        if inspect.isasyncgen(result):
            async for response in result:
                yield response
        else:  # a coroutine that answers with context.write()
            await result

    if handler.request_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming_response, deserializer, serializer)
    return grpc.unary_stream_rpc_method_handler(streaming_response, deserializer, serializer)


class TenantAuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call on the public port with the tenant registry.

    A call with no key or a wrong one ends with UNAUTHENTICATED before its
    handler runs; otherwise the handler runs with `current_tenant()` set.
    Health and reflection stay open (`exempt_services`), so load balancers and
    grpcurl need no key. Put it first in the server's interceptors: a refused
    call then runs none of the handlers the later ones wrap. Handlers must be
    coroutines or async generators, as on every aio servicer here. Refusals are
    logged at a bounded rate: a caller without a key decides how often it is
    refused, not how much the server logs.
    """

    def __init__(
        self, registry: TenantRegistry, exempt_services: Iterable[str] = (HEALTH_SERVICE, *REFLECTION_SERVICES)
    ) -> None:
        self.registry = registry
        self.exempt_services = frozenset(exempt_services)
        self.refusals = RateLimitedLog(logger, logging.INFO)
        install_metadata_encoding_filter()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        # None for a method no servicer has (grpc-stubs leave None out).
        handler: grpc.RpcMethodHandler | None = await continuation(handler_call_details)
        if handler is None or service_of(handler_call_details.method) in self.exempt_services:
            return handler  # type: ignore[return-value]  # grpc takes None: no such method
        try:
            tenant = self.registry.authenticate(handler_call_details.invocation_metadata)
        except AuthenticationError as error:
            # The method is one this server serves (handler is not None): a bounded set.
            self.refusals.log("api-key", "refused %s: %s", handler_call_details.method, error.message)
            return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, error.message)
        return _with_tenant(handler, tenant)
