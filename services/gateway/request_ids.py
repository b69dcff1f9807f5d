"""The id a submitted request carries: the client's Idempotency-Key (a retried POST attaches to the same job),
or a fresh one."""

from __future__ import annotations

import uuid

from fastapi import Request

from services.gateway.errors import invalid

MAX_IDEMPOTENCY_KEY_CHARS = 100


def request_id(request: Request) -> str:
    """The client's Idempotency-Key (a retried POST attaches to the same job), or a fresh id."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return uuid.uuid4().hex
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS:
        raise invalid("Idempotency-Key", f"use 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters")
    return key
