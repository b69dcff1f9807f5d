"""Structured logs: JSON lines, job fields from context variables, trace ids from the current span."""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import io
import json
import logging
from collections.abc import Iterator
from pathlib import PurePosixPath

import pytest
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.sdk.trace import TracerProvider

from services.logging_setup import (
    add_logging_arguments,
    bind_log_fields,
    configure_logging,
    log_context,
    log_fields,
    make_handler,
)
from services.tracing import start_span_under

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def capture() -> Iterator[tuple[logging.Logger, io.StringIO, logging.Handler]]:
    """A logger of its own writing JSON lines into a buffer (the root logger is left alone)."""
    stream = io.StringIO()
    handler = make_handler("json", stream)
    logger = logging.getLogger("tests.logging_setup")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield logger, stream, handler
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_one_json_object_per_line_with_the_standard_fields(capture) -> None:
    logger, stream, _ = capture
    logger.info("job %s queued:\n%dx%d", "a", 64, 64)
    logger.warning("second")
    first, second = lines(stream)
    assert list(first)[:4] == ["time", "level", "logger", "message"]
    assert first["level"] == "INFO" and second["level"] == "WARNING"
    assert first["logger"] == "tests.logging_setup"
    assert first["message"] == "job a queued:\n64x64"
    assert first["time"].endswith("+00:00")
    for field in ("job_id", "tenant", "stage", "trace_id", "span_id", "exception"):
        assert field not in first


def test_context_fields_extras_and_exceptions(capture) -> None:
    logger, stream, _ = capture
    with log_context(job_id="job-1", tenant="acme", stage="dit"):
        logger.info("step", extra={"step": 3, "model": PurePosixPath("/models/tiny")})
        with log_context(stage="vae"):
            logger.info("decode")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed")
    logger.info("after")
    step, decode, failed, after = lines(stream)
    assert (step["job_id"], step["tenant"], step["stage"]) == ("job-1", "acme", "dit")
    assert step["step"] == 3 and step["model"] == "/models/tiny"
    assert decode["stage"] == "vae" and decode["job_id"] == "job-1"
    assert failed["level"] == "ERROR"
    assert "RuntimeError: boom" in failed["exception"]
    assert "job_id" not in after and "stage" not in after


def test_job_id_follows_each_job_task_and_the_tasks_it_starts(capture) -> None:
    logger, stream, _ = capture

    async def stage_call(name: str) -> None:
        await asyncio.sleep(0)
        logger.info("calling %s", name)

    async def job(job_id: str, started: asyncio.Event, other_started: asyncio.Event) -> None:
        with log_context(job_id=job_id, tenant=f"tenant-{job_id}"):
            logger.info("start")
            started.set()
            await other_started.wait()  # both jobs are now inside their contexts at once
            await asyncio.gather(stage_call("text-encoder"), stage_call("dit"))
            logger.info("end")

    async def main() -> None:
        a, b = asyncio.Event(), asyncio.Event()
        await asyncio.gather(
            asyncio.create_task(job("a", a, b)),
            asyncio.create_task(job("b", b, a)),
        )
        logger.info("outside")

    asyncio.run(main())
    records = lines(stream)
    assert len(records) == 9
    by_job: dict[str, list[str]] = {}
    for record in records[:-1]:
        assert record["tenant"] == f"tenant-{record['job_id']}"
        by_job.setdefault(record["job_id"], []).append(record["message"])
    for messages in by_job.values():
        assert messages[0] == "start" and messages[-1] == "end"
        assert sorted(messages[1:3]) == ["calling dit", "calling text-encoder"]
    assert sorted(by_job) == ["a", "b"]
    assert records[-1]["message"] == "outside" and "job_id" not in records[-1]


def test_bind_log_fields_sets_and_removes(capture) -> None:
    logger, stream, _ = capture

    def in_own_context() -> None:
        bind_log_fields(job_id="j", stage="dit")
        bind_log_fields(stage=None)
        assert dict(log_fields()) == {"job_id": "j"}
        logger.info("inside")

    contextvars.copy_context().run(in_own_context)
    logger.info("outside")
    inside, outside = lines(stream)
    assert inside["job_id"] == "j" and "stage" not in inside
    assert "job_id" not in outside


def test_trace_and_span_ids_of_the_current_span(capture) -> None:
    logger, stream, _ = capture
    # No SDK: the span extracted from an incoming traceparent is current and carries its ids.
    with start_span_under(extract({"traceparent": TRACEPARENT}), "handler"):
        logger.info("propagated")
    provider = TracerProvider()
    with provider.get_tracer("test").start_as_current_span("recorded") as span:
        logger.info("recorded")
    propagated, recorded = lines(stream)
    assert propagated["trace_id"] == TRACE_ID and propagated["span_id"] == "00f067aa0ba902b7"
    assert recorded["trace_id"] == trace.format_trace_id(span.get_span_context().trace_id)
    assert recorded["span_id"] == trace.format_span_id(span.get_span_context().span_id)


def test_text_format_appends_job_fields() -> None:
    stream = io.StringIO()
    logger = logging.getLogger("tests.logging_setup.text")
    handler = make_handler("text", stream)
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        logger.info("plain")
        with log_context(job_id="j9", stage="vae"):
            logger.info("tagged")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    plain, tagged = stream.getvalue().splitlines()
    assert plain.endswith(" INFO tests.logging_setup.text: plain")
    assert tagged.endswith(" INFO tests.logging_setup.text: tagged [job_id=j9 stage=vae]")


def test_configure_logging_routes_every_logger_to_one_handler() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        configure_logging("warning", "json", stream)
        logging.getLogger("services.orchestrator.jobs").info("not shown")
        logging.getLogger("services.orchestrator.jobs").warning("shown")
        assert len(root.handlers) == 1
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    (record,) = lines(stream)
    assert record["message"] == "shown" and record["logger"] == "services.orchestrator.jobs"


def test_log_format_argument() -> None:
    parser = argparse.ArgumentParser()
    add_logging_arguments(parser, with_level=True)
    assert parser.parse_args([]).log_format == "text"
    args = parser.parse_args(["--log-format", "json", "--log-level", "DEBUG"])
    assert (args.log_format, args.log_level) == ("json", "DEBUG")
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])
    with pytest.raises(ValueError, match="allowed: text, json"):
        make_handler("xml")
