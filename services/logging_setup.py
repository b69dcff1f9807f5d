"""Logging for every StageDiff process: plain text for people, JSON lines for log pipelines.

`--log-format json` writes one JSON object per line with `time` (UTC, ISO
8601), `level`, `logger` and `message`, then, when set, `job_id`, `tenant`,
`stage`, `trace_id` and `span_id`, any `extra=` fields, and `exception`.

Job fields live in a context variable: `log_context(job_id=...)` around a job's
work tags everything logged inside it, including in tasks started from there
(asyncio copies context variables into new tasks), while concurrent jobs keep
their own. `trace_id` / `span_id` come from the current OpenTelemetry span, so
a log line can be found from a trace and back.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import datetime
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, TextIO

from opentelemetry import trace

LOG_FORMATS = ("text", "json")
CONTEXT_FIELDS = ("job_id", "tenant", "stage")
TRACE_FIELDS = ("trace_id", "span_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_fields: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "stagediff_log_fields", default=MappingProxyType({})
)

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_STASH = "_stagediff_context"


def log_fields() -> Mapping[str, str]:
    """The fields set for the current context (job_id, tenant, stage, ...)."""
    return _fields.get()


def bind_log_fields(**fields: str | None) -> contextvars.Token:
    """Adds fields to the current context (None removes one); returns the token that undoes it.

    For code that owns its context, such as the top of a job's task; elsewhere
    prefer `log_context`, which undoes it by itself.
    """
    merged = dict(_fields.get())
    for key, value in fields.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = str(value)
    return _fields.set(MappingProxyType(merged))


@contextlib.contextmanager
def log_context(**fields: str | None) -> Iterator[None]:
    """Tags everything logged inside the block (and in tasks it starts) with `fields`."""
    token = bind_log_fields(**fields)
    try:
        yield
    finally:
        _fields.reset(token)


def _context_of(record: logging.LogRecord) -> dict[str, str]:
    """The context fields of a record: stashed by ContextFilter where it ran, else read now."""
    stashed = getattr(record, _STASH, None)
    if stashed is not None:
        return stashed
    context = dict(_fields.get())
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        context["trace_id"] = trace.format_trace_id(span_context.trace_id)
        context["span_id"] = trace.format_span_id(span_context.span_id)
    return context


class ContextFilter(logging.Filter):
    """Captures the context fields and trace ids on each record while still in the logging code's context.

    Put on a handler; handlers that format later, elsewhere (a QueueHandler's
    listener), then still see the fields of the code that logged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        setattr(record, _STASH, _context_of(record))
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        context = _context_of(record)
        for key in (*CONTEXT_FIELDS, *TRACE_FIELDS):
            if key in context:
                entry[key] = context[key]
        for key, value in context.items():
            entry.setdefault(key, value)
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and key != _STASH:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The classic line, followed by [job_id=... tenant=... stage=...] when a job context is set."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        context = _context_of(record)
        tags = " ".join(f"{key}={context[key]}" for key in CONTEXT_FIELDS if key in context)
        return f"{line} [{tags}]" if tags else line


def make_handler(log_format: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """A stream handler (stderr by default) with the formatter for `log_format` and the ContextFilter."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format {log_format}: allowed: {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    return handler


def configure_logging(level: str = "INFO", log_format: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Sends every logger's records to one handler on the root logger, replacing earlier handlers."""
    handler = make_handler(log_format, stream)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
    return handler


def add_logging_arguments(parser: argparse.ArgumentParser, *, with_level: bool = False) -> None:
    """Adds --log-format (and --log-level when the parser has none yet)."""
    if with_level:
        parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: one readable line per record; json: one JSON object per line, with job and trace ids",
    )
