"""The SDK's typed errors and its retries of RESOURCE_EXHAUSTED: the class each status code maps to, the field of an
INVALID_ARGUMENT and the stage of an UNAVAILABLE (from rich details or the message), and retries that wait what the
server asks and stop at their bound; against grpc.aio errors built here and an in-process fake server."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

import stagediff
from stagediff import client as client_module
from stagediff.client import (
    AsyncClient,
    AuthenticationError,
    Cancelled,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RateLimitError,
    RetryPolicy,
    StageDiffError,
    Unavailable,
)
from stagediff.errors import STAGE_METADATA_KEY
from stagediff.protocol import JOB_FAILED_METADATA_KEY
from stagediff.retries import Retries
from stagediff.status_details import DETAILS_METADATA_KEY, abort_with_retry
from stagediff.tensor_codec import encode_tensor
from stagediff.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers.fake_client_server import FakeServer

FRAMES = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)


def rpc_error(code: grpc.StatusCode, message: str, *details, trailing=()) -> grpc.aio.AioRpcError:
    """A failed call's error as grpc.aio raises it, with a google.rpc.Status holding `details` in its trailer."""
    metadata = list(trailing)
    if details:
        status = status_pb2.Status(code=code.value[0], message=message)
        for detail in details:
            status.details.add().Pack(detail)
        metadata.append((DETAILS_METADATA_KEY, status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*metadata), message)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.UNAUTHENTICATED, AuthenticationError),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, RateLimitError),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, Cancelled),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.INTERNAL, InternalError),
        (grpc.StatusCode.UNKNOWN, InternalError),
        (grpc.StatusCode.DATA_LOSS, InternalError),
        (grpc.StatusCode.ALREADY_EXISTS, StageDiffError),
    ],
)
def test_each_status_code_maps_to_its_class(code: grpc.StatusCode, kind: type[StageDiffError]) -> None:
    error = StageDiffError.from_rpc_error(rpc_error(code, "why"))
    assert type(error) is kind and isinstance(error, StageDiffError)
    assert (error.code, error.message, error.retry_after) == (code, "why", None)
    assert str(error) == f"{code.name}: why"


def test_the_errors_are_exported_from_the_package() -> None:
    assert stagediff.InvalidArgument is InvalidArgument and stagediff.RateLimitError is RateLimitError
    assert client_module.StageDiffError is stagediff.StageDiffError


def test_invalid_argument_names_the_field_of_a_bad_request_detail() -> None:
    violation = error_details_pb2.BadRequest.FieldViolation(field="loras[0].scale", description="too large")
    error = StageDiffError.from_rpc_error(
        rpc_error(
            grpc.StatusCode.INVALID_ARGUMENT, "bad scale", error_details_pb2.BadRequest(field_violations=[violation])
        )
    )
    assert isinstance(error, InvalidArgument) and error.field == "loras[0].scale"


def test_invalid_argument_names_the_field_its_message_starts_with() -> None:
    """The orchestrator's refusals start with the field's path (stagekit/errors.py RequestError)."""
    for message, field in (
        ("height: 63 is not allowed; use a multiple of 16", "height"),
        ("images[1].data: not an image Pillow can identify", "images[1].data"),
        ("cache.method: 'x' is not offered for this model", "cache.method"),
        ("the request is not valid", None),
    ):
        error = StageDiffError.from_rpc_error(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, message))
        assert error.field == field, message


def test_unavailable_names_the_stage_from_error_info_or_the_message() -> None:
    info = error_details_pb2.ErrorInfo(reason="STAGE_UNAVAILABLE", metadata={STAGE_METADATA_KEY: "dit"})
    from_info = StageDiffError.from_rpc_error(rpc_error(grpc.StatusCode.UNAVAILABLE, "down", info))
    from_message = StageDiffError.from_rpc_error(
        rpc_error(grpc.StatusCode.UNAVAILABLE, "stage 'vae' at 10.0.0.1:50053 is unavailable: connection refused")
    )
    unnamed = StageDiffError.from_rpc_error(rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect"))
    assert (from_info.stage, from_message.stage, unnamed.stage) == ("dit", "vae", None)


def test_rate_limit_error_carries_the_retry_delay() -> None:
    info = error_details_pb2.RetryInfo(retry_delay=Duration(seconds=2, nanos=500_000_000))
    error = StageDiffError.from_rpc_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", info))
    assert isinstance(error, RateLimitError) and error.retry_after == 2.5


class Refusing(generation_pb2_grpc.GenerationServicer):
    """Refuses the first `refusals` Generate and Submit calls with RESOURCE_EXHAUSTED and a RetryInfo of
    `retry_after` seconds (none when None), then answers; records when each call came."""

    def __init__(self, refusals: int, retry_after: float | None) -> None:
        self.refusals = refusals
        self.retry_after = retry_after
        self.calls: list[tuple[float, str]] = []

    async def _refuse_while_due(self, request, context) -> None:
        self.calls.append((time.monotonic(), request.request_id))
        if len(self.calls) <= self.refusals:
            if self.retry_after is None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
            await abort_with_retry(context, "queue full", self.retry_after)

    async def Generate(self, request, context):
        await self._refuse_while_due(request, context)
        for chunk in encode_tensor("frames", FRAMES, index=0):
            yield generation_pb2.GenerateEvent(job_id="j", result=generation_pb2.ResultChunk(tensor=chunk, fps=8))
        yield generation_pb2.GenerateEvent(job_id="j", completed=generation_pb2.JobCompleted(num_frames=2, fps=8))

    async def Submit(self, request, context):
        await self._refuse_while_due(request, context)
        return generation_pb2.Job(job_id="j", state=generation_pb2.JOB_STATE_QUEUED)


@pytest.fixture
def refusing():
    servers: list[FakeServer] = []

    def make(refusals: int, retry_after: float | None = 0.2) -> FakeServer:
        servers.append(FakeServer(Refusing(refusals, retry_after)))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def test_generate_waits_the_servers_retry_after_then_succeeds(refusing) -> None:
    server = refusing(refusals=2, retry_after=0.2)
    with Client(f"127.0.0.1:{server.port}") as client:
        result = client.generate("a fox")
    assert np.array_equal(result.frames, FRAMES)
    times = [at for at, _ in server.servicer.calls]
    assert len(times) == 3 and all(later - earlier >= 0.2 for earlier, later in zip(times, times[1:], strict=False))
    assert len({request_id for _, request_id in server.servicer.calls}) == 1, "each retry carries the same request id"


def test_rate_limit_retries_give_up_after_their_count(refusing) -> None:
    server = refusing(refusals=10, retry_after=0.01)
    retry = RetryPolicy(rate_limit_retries=2)
    with Client(f"127.0.0.1:{server.port}", retry=retry) as client, pytest.raises(RateLimitError) as raised:
        client.generate("a fox")
    assert len(server.servicer.calls) == 3 and raised.value.retry_after == 0.01


def test_a_wait_beyond_the_bound_raises_at_once(refusing) -> None:
    server = refusing(refusals=1, retry_after=30)
    retry = RetryPolicy(rate_limit_max_wait_s=1.0)
    with Client(f"127.0.0.1:{server.port}", retry=retry) as client, pytest.raises(RateLimitError) as raised:
        client.generate("a fox")
    assert len(server.servicer.calls) == 1 and raised.value.retry_after == 30


def test_zero_rate_limit_retries_disables_them(refusing) -> None:
    server = refusing(refusals=1)
    retry = RetryPolicy(rate_limit_retries=0)
    with Client(f"127.0.0.1:{server.port}", retry=retry) as client, pytest.raises(RateLimitError):
        client.submit("a fox")
    assert len(server.servicer.calls) == 1


def test_submit_is_retried_with_backoff_when_the_server_gives_no_delay(refusing) -> None:
    server = refusing(refusals=2, retry_after=None)
    retry = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.02)

    async def run() -> generation_pb2.Job:
        async with AsyncClient(f"127.0.0.1:{server.port}", retry=retry) as client:
            return await client.submit("a fox", request_id="mine")

    assert asyncio.run(run()).job_id == "j"
    assert [request_id for _, request_id in server.servicer.calls] == ["mine"] * 3


def test_a_job_that_failed_for_resources_is_not_retried() -> None:
    retries = Retries(RetryPolicy())
    failed_job = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "volume full", trailing=[(JOB_FAILED_METADATA_KEY, "1")])
    assert retries.delay(failed_job) is None
    assert (
        Retries(RetryPolicy(), allowed=False).delay(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")) is None
    )


def test_a_rich_status_from_a_real_server_reaches_the_error() -> None:
    """BadRequest details sent with abort_with_status arrive through grpc's trailer."""

    class Refuses(generation_pb2_grpc.GenerationServicer):
        async def GetJob(self, request, context):
            violation = error_details_pb2.BadRequest.FieldViolation(field="job_id", description="empty")
            status = status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="job_id: empty")
            status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
            await context.abort_with_status(rpc_status.to_status(status))

    server = FakeServer(Refuses())
    try:
        with Client(f"127.0.0.1:{server.port}") as client, pytest.raises(InvalidArgument) as raised:
            client.get_job("")
    finally:
        server.stop()
    assert raised.value.field == "job_id" and raised.value.message == "job_id: empty"
