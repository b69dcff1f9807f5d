"""The gateway's connection to the orchestrator: a gRPC channel (one per orchestrator replica, the next used
when one is UNAVAILABLE), each call made with its HTTP caller's key.

The gateway holds no tenants and no jobs: it forwards the caller's `Authorization: Bearer <key>` as the
call's `authorization` metadata, so the orchestrator authenticates, applies the tenant's quotas and owns
the job exactly as for a gRPC client. A failed call raises the SDK's typed error (stagediff/errors.py),
which errors.py turns into the HTTP answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagediff.async_client import CHANNEL_OPTIONS
from stagediff.errors import StageDiffError
from stagediff.status_details import retry_after
from stagediff.uploads import with_uploads
from stagediff.v1 import generation_pb2, generation_pb2_grpc, image_pb2

_Reply = TypeVar("_Reply")

# Unary calls (submit, get, list, cancel, delete, models) are quick; a stream runs as long as its job.
UNARY_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 2.0


class Orchestrator:
    """The orchestrator's Generation API, its calls made with each HTTP caller's key.

    The gRPC channel belongs to an event loop, so it is opened on the first call, in the server's loop.
    """

    def __init__(self, endpoint: str, *, ca_cert: str | None = None, tls: bool = False) -> None:
        self.endpoint = endpoint
        self.endpoints = [part.strip() for part in endpoint.split(",") if part.strip()]
        self._credentials = None
        if tls or ca_cert is not None:
            root = Path(ca_cert).read_bytes() if ca_cert is not None else None
            self._credentials = grpc.ssl_channel_credentials(root_certificates=root)
        self._channel: grpc.aio.Channel | None = None
        self._current = 0
        self._closing: asyncio.Future[None] | None = None  # the channel of a replica left behind, closing

    def _open(self) -> None:
        endpoint = self.endpoints[self._current]
        if self._credentials is not None:
            self._channel = grpc.aio.secure_channel(endpoint, self._credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _after_failure(self, error: grpc.aio.AioRpcError) -> None:
        """Moves the next calls to the next replica after an UNAVAILABLE one (the caller's retry reaches it)."""
        if error.code() == grpc.StatusCode.UNAVAILABLE and retry_after(error) is None and len(self.endpoints) > 1:
            self._current = (self._current + 1) % len(self.endpoints)
            channel, self._channel = self._channel, None
            if channel is not None:
                self._closing = asyncio.ensure_future(channel.close(grace=None))

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        if self._channel is None:
            self._open()
        return self._stub

    @property
    def health(self) -> health_pb2_grpc.HealthStub:
        if self._channel is None:
            self._open()
        return self._health

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)  # no grace: grpc-stubs lack the default
            self._channel = None

    async def _call(
        self, method: Callable[..., Awaitable[_Reply]], request: Message | Sequence[Message], authorization: str | None
    ) -> _Reply:
        try:
            return await method(request, timeout=UNARY_TIMEOUT_S, metadata=_metadata(authorization))
        except grpc.aio.AioRpcError as error:
            self._after_failure(error)
            raise StageDiffError.from_rpc_error(error) from None

    async def submit(self, request: generation_pb2.GenerateRequest, authorization: str | None) -> generation_pb2.Job:
        """Queues the job, its images over 1 MiB sent ahead through UploadImage (stagediff/uploads.py)."""

        async def upload(chunks: list[image_pb2.ImageUploadChunk]) -> image_pb2.UploadedImage:
            return await self._call(
                lambda sent, **call: self.stub.UploadImage(iter(sent), **call), chunks, authorization
            )

        return await self._call(self.stub.Submit, await with_uploads(request, upload), authorization)

    async def get_job(self, job_id: str, authorization: str | None) -> generation_pb2.Job:
        return await self._call(self.stub.GetJob, generation_pb2.GetJobRequest(job_id=job_id), authorization)

    async def list_jobs(self, limit: int, authorization: str | None) -> list[generation_pb2.Job]:
        request = generation_pb2.ListJobsRequest(limit=limit)
        return list((await self._call(self.stub.ListJobs, request, authorization)).jobs)

    async def delete_job(self, job_id: str, authorization: str | None) -> generation_pb2.DeleteJobResponse:
        request = generation_pb2.DeleteJobRequest(job_id=job_id)
        return await self._call(self.stub.DeleteJob, request, authorization)

    async def list_models(self, authorization: str | None) -> list[generation_pb2.ModelDescription]:
        request = generation_pb2.ListModelsRequest()
        return list((await self._call(self.stub.ListModels, request, authorization)).models)

    async def watch(self, job_id: str, authorization: str | None) -> AsyncGenerator[generation_pb2.GenerateEvent, None]:
        """The job's events from its first (its result included), as WatchJob streams them."""
        call = self.stub.WatchJob(generation_pb2.WatchJobRequest(job_id=job_id), metadata=_metadata(authorization))
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as error:
            self._after_failure(error)
            raise StageDiffError.from_rpc_error(error) from None
        finally:
            call.cancel()

    async def serving(self) -> bool:
        """Whether the orchestrator answers its health check with SERVING."""
        try:
            response = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            self._after_failure(error)
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING


def _metadata(authorization: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", authorization),) if authorization else ()
