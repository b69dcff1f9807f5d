"""Length limits on every string and repeated field of the public requests, checked before anything else.

A field's value can reach a log line, a metric label, the job store or an
error message; a caller who may send megabytes in one field must be refused
before any of them sees it. Each public request type lists the limit of every
string, bytes and repeated field it has (nested messages included);
`check_bounds` walks the message and refuses the first field over its limit
with a RequestError (INVALID_ARGUMENT) that names the field and the limit,
never the value. A field with no entry in `FIELD_LIMITS` is refused too, so a
field added to the proto without a limit fails loudly (and a test checks
that every field has one). Unknown fields (bytes a newer or hostile client
added) are dropped, so that they are neither stored nor echoed back.

The limits are generous upper bounds on what any valid request needs; the
model's own limits (e.g. `ModelLimits.max_prompt_chars`) are checked later,
once the model is known.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, cast

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message

from services.images import MAX_IMAGE_BYTES
from services.orchestrator.image_uploads import MAX_CHUNK_BYTES
from services.validation import MAX_LORAS_PER_REQUEST
from stagekit.errors import RequestError

MAX_MODEL_ID_CHARS = 128
MAX_TEXT_CHARS = 65_536  # above any model's max_prompt_chars (10,000 for the families served today)
MAX_REQUEST_ID_CHARS = 128
MAX_JOB_ID_CHARS = 64  # job ids are 32 hex digits
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux
MAX_IMAGES = 4  # above any family's image roles (first and last frame; an image to edit)
MAX_DIGEST_CHARS = 64  # a hex SHA-256
MAX_CACHE_METHOD_CHARS = 32  # the longest step cache name is 11
MAX_LORAS = MAX_LORAS_PER_REQUEST  # above any DiT's --max-loras-per-request
MAX_OUTPUT_FORMAT_CHARS = 16  # the longest name in services/orchestrator/encoding.py OUTPUT_FORMATS, and room
MAX_AUDIO_CODEC_CHARS = 16  # the longest of services/encoding.py's audio codecs is 4, and room
MAX_LORA_NAME_CHARS = 129  # TENANT/NAME, 64 characters each (services/validation.py LORA_NAME)
# A front end's notices of what it changed (GenerateRequest.notices): a few, each a field, values and a sentence.
MAX_REQUEST_NOTICES = 8
MAX_NOTICE_PART_CHARS = 64
MAX_NOTICE_MESSAGE_CHARS = 512

# Full message name -> field name -> the most characters (strings), bytes (bytes) or entries (repeated).
FIELD_LIMITS: dict[str, dict[str, int]] = {
    "stagediff.v1.GenerateRequest": {
        "model": MAX_MODEL_ID_CHARS,
        "prompt": MAX_TEXT_CHARS,
        "negative_prompt": MAX_TEXT_CHARS,
        "request_id": MAX_REQUEST_ID_CHARS,
        "images": MAX_IMAGES,
        "loras": MAX_LORAS,
        "output_format": MAX_OUTPUT_FORMAT_CHARS,
        "audio_codec": MAX_AUDIO_CODEC_CHARS,
        "notices": MAX_REQUEST_NOTICES,
    },
    "stagediff.v1.Notice": {
        "field": MAX_NOTICE_PART_CHARS,
        "given": MAX_NOTICE_PART_CHARS,
        "used": MAX_NOTICE_PART_CHARS,
        "message": MAX_NOTICE_MESSAGE_CHARS,
        "source": MAX_NOTICE_PART_CHARS,
    },
    "stagediff.v1.LoraAdapter": {"name": MAX_LORA_NAME_CHARS},
    # Each image at most all of a request's image bytes; the model's own limits are checked once it is known.
    "stagediff.v1.InputImage": {"data": MAX_IMAGE_BYTES, "sha256": MAX_DIGEST_CHARS, "upload_id": MAX_JOB_ID_CHARS},
    "stagediff.v1.ImageUploadChunk": {"data": MAX_CHUNK_BYTES},
    "stagediff.v1.InterpolationParams": {"model_path": MAX_PATH_CHARS},
    "stagediff.v1.StepCache": {"method": MAX_CACHE_METHOD_CHARS},
    "stagediff.v1.GetJobRequest": {"job_id": MAX_JOB_ID_CHARS},
    "stagediff.v1.WatchJobRequest": {"job_id": MAX_JOB_ID_CHARS},
    "stagediff.v1.CancelJobRequest": {"job_id": MAX_JOB_ID_CHARS},
    "stagediff.v1.DeleteJobRequest": {"job_id": MAX_JOB_ID_CHARS},
    "stagediff.v1.ListJobsRequest": {},
    "stagediff.v1.ListModelsRequest": {},
    "stagediff.v1.GetClusterInfoRequest": {},
}

_SIZED_TYPES = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def sized_fields(descriptor: Descriptor) -> list[tuple[str, FieldDescriptor]]:
    """(path, field) of every string, bytes and repeated field under a message type, nested ones included."""
    found: list[tuple[str, FieldDescriptor]] = []

    def walk(message_descriptor: Descriptor, prefix: str) -> None:
        for field in cast(list[FieldDescriptor], message_descriptor.fields):
            path = f"{prefix}{field.name}"
            if _is_repeated(field) or field.type in _SIZED_TYPES:
                found.append((path, field))
            if field.type == FieldDescriptor.TYPE_MESSAGE and not _is_repeated(field) and field.message_type:
                walk(field.message_type, f"{path}.")

    walk(descriptor, "")
    return found


def check_bounds(request: Message, prefix: str = "") -> None:
    """Raises RequestError naming the first field of `request` over its limit; drops unknown fields."""
    request.DiscardUnknownFields()
    name = request.DESCRIPTOR.full_name
    limits = FIELD_LIMITS.get(name)
    if limits is None:
        raise RequestError(f"request: {name} has no field limits; it cannot be accepted")
    # types-protobuf type the fields as the pure-Python or the upb descriptor; both have these attributes.
    for field in cast(list[FieldDescriptor], request.DESCRIPTOR.fields):
        path = f"{prefix}{field.name}"
        if _is_repeated(field) or field.type in _SIZED_TYPES:
            limit = limits.get(field.name)
            if limit is None:
                raise RequestError(f"{path}: this field has no length limit here; leave it empty")
            size = len(getattr(request, field.name))
            if size > limit:
                unit = "characters" if field.type == FieldDescriptor.TYPE_STRING else "bytes"
                if _is_repeated(field):
                    unit = "entries"
                raise RequestError(f"{path}: {size} {unit}; at most {limit} are allowed")
        if field.type != FieldDescriptor.TYPE_MESSAGE or field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            continue
        if _is_repeated(field):
            for index, item in enumerate(getattr(request, field.name)):
                check_bounds(item, f"{path}[{index}].")
        elif request.HasField(field.name):
            check_bounds(getattr(request, field.name), f"{path}.")


class RequestBoundsInterceptor(grpc.aio.ServerInterceptor):
    """Runs `check_bounds` on every request of `services` before its handler, answering INVALID_ARGUMENT.

    For unary-request methods, and for each message of a request stream (UploadImage's chunks), which
    is refused at the first message over its limits. Put it after the authentication interceptor, so that
    an unauthenticated call is refused before its request is looked at.
    """

    def __init__(self, services: Iterable[ServiceDescriptor]) -> None:
        services = list(services)
        for service in services:
            for method in service.methods:
                if method.client_streaming and method.server_streaming:
                    raise ValueError(f"{method.full_name}: bidirectional streams are not checked; bound them elsewhere")
        self.services = frozenset(service.full_name for service in services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        # None for a method no servicer has (grpc-stubs leave None out).
        handler: grpc.RpcMethodHandler | None = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if handler is None or service not in self.services:
            return handler  # type: ignore[return-value]  # grpc takes None: no such method
        deserializer, serializer = handler.request_deserializer, handler.response_serializer
        # grpc-stubs type the behaviours as sync functions; a grpc.aio server's are coroutines and async generators.
        if handler.unary_unary is not None:
            inner: Callable[..., Any] = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await _check(request, context)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)
        if handler.stream_unary is not None:
            inner_upload: Callable[..., Any] = handler.stream_unary

            async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                return await inner_upload(_checked(requests), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, deserializer, serializer)
        inner_stream: Callable[..., Any] | None = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            assert inner_stream is not None  # bidirectional streams were refused above
            await _check(request, context)
            async for response in inner_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, serializer)


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The messages of a request stream, each checked; RequestError at the first over its limits."""
    async for request in requests:
        if isinstance(request, Message):
            check_bounds(request)
        yield request


async def _check(request: Any, context: grpc.aio.ServicerContext) -> None:
    # Bytes that did not parse arrive as a placeholder, which the request-decoding interceptor refuses.
    if not isinstance(request, Message):
        return
    try:
        check_bounds(request)
    except RequestError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
