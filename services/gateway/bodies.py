"""Request bodies within bounds: their size, their parsing off the event loop, their spooled files' lifetime.

`BodyLimit` (ASGI middleware) answers 413 to a body over the limit, at once from its Content-Length or when its
chunks add up to it. `read_body` gives a route the body's fields as a pydantic model and its uploaded files, and
closes (deletes) the files when the route is done or the body ends early; a JSON body is parsed in a worker
thread, and a body nested too deeply or not JSON is a 400 naming `body`, never a 500.
The limit is `--max-body-bytes` (options.py: by default one input image as a base64 data URL, the largest
legitimate body).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import ApiError, invalid, validation_error

MAX_FORM_FIELDS = 64
MAX_FORM_FILES = 16

_Body = TypeVar("_Body", bound=BaseModel)


def too_large(limit: int) -> ApiError:
    # Connection: close, so that the rest of a body nobody reads is not received either.
    return ApiError(
        413, f"the request body is larger than {limit} bytes", code="body_too_large", headers={"Connection": "close"}
    )


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` is answered 413, whether its Content-Length says so at once or
    its chunks add up to it (the route reading it gets the error, which the ApiError handler answers)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, limited, send)


@contextlib.asynccontextmanager
async def read_body(
    request: Request, model: type[_Body], ignore: tuple[str, ...] = ()
) -> AsyncIterator[tuple[_Body, dict[str, list[UploadFile]]]]:
    """The body as `model` (a 400 naming the first bad field), and its uploaded files by field name, which are
    closed, and so deleted, when the block ends."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    files: dict[str, list[UploadFile]] = {}
    try:
        if content_type == "application/json":
            fields = await asyncio.to_thread(parse_json, await request.body())
        elif content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
            form = await request.form(max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS)
            fields = {}
            for key, value in form.multi_items():
                if isinstance(value, UploadFile):
                    files.setdefault(key, []).append(value)
                elif key not in ignore:
                    fields[key] = value
        else:
            raise ApiError(415, f"Content-Type {content_type or '(none)'}: use application/json or multipart/form-data")
        if "input_reference" in files:
            fields.pop("input_reference", None)
        yield _validated(model, fields), files
    finally:
        await request.close()  # closes the form's files (spooled to disk beyond 1 MiB)


def parse_json(body: bytes) -> dict[str, Any]:
    """A JSON object from `body`; 400 for anything else (run it in a worker thread: a large body takes a while)."""
    try:
        fields = json.loads(body)
    except RecursionError:
        raise invalid("body", "the JSON is nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise invalid("body", f"not valid JSON ({str(error)[:200]})") from None
    if not isinstance(fields, dict):
        raise invalid("body", "a JSON object is expected")
    return fields


def _validated(model: type[_Body], fields: dict[str, Any]) -> _Body:
    try:
        return model.model_validate(fields)
    except ValidationError as error:
        raise validation_error(error.errors()) from None
    except (RecursionError, ValueError) as error:
        raise invalid("body", f"not a valid request ({str(error)[:200]})") from None
