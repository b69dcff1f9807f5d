"""The HTTP gateway against callers without a key and callers who hold its resources: idle and half-sent
connections are closed within a bound while /healthz answers; a body without a key is refused before it is read
(no temp files for an unfinished upload, no memory for a 64 MiB JSON); deep JSON is a 400; a raw job's download
is a 409, not an encode per download; downloads per key are bounded; the progress stream does not read the
result; /docs is not served.

The gateway runs as `stagediff serve http` does (its own process, with its defaults unless a test says), in
front of a fake orchestrator in this process that takes the key "good" and knows three jobs.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services.auth import REFUSAL_LOG_INTERVAL_S
from stagediff.v1 import generation_pb2, generation_pb2_grpc

KEY = "Bearer good"
MIB = 1 << 20


class FakeOrchestrator(generation_pb2_grpc.GenerationServicer):
    """Takes the key "good". Jobs: "raw" (raw frames), "slow" (an MP4 whose bytes never end) and "endless" (an
    MP4 job whose WatchJob sends result chunks until the caller stops reading, and GetJob says it succeeded)."""

    def __init__(self) -> None:
        self.result_chunks_sent = 0
        self.list_limits: list[int] = []

    def _authenticate(self, context) -> None:
        if dict(context.invocation_metadata()).get("authorization") != KEY:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")

    def ListModels(self, request, context):
        self._authenticate(context)
        return generation_pb2.ListModelsResponse()

    def ListJobs(self, request, context):
        self._authenticate(context)
        self.list_limits.append(request.limit)
        jobs = [generation_pb2.Job(job_id=job_id, state=generation_pb2.JOB_STATE_SUCCEEDED) for job_id in "cba"]
        return generation_pb2.ListJobsResponse(jobs=jobs[: request.limit])

    def GetJob(self, request, context):
        self._authenticate(context)
        output_format = {"raw": "", "slow": "mp4", "endless": "mp4"}.get(request.job_id)
        if output_format is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"job_id: no job '{request.job_id}'")
        job_request = generation_pb2.GenerateRequest(width=64, height=64, num_frames=9, output_format=output_format)
        return generation_pb2.Job(job_id=request.job_id, state=generation_pb2.JOB_STATE_SUCCEEDED, request=job_request)

    def WatchJob(self, request, context):
        self._authenticate(context)
        yield generation_pb2.GenerateEvent(job_id=request.job_id, queued=generation_pb2.JobQueued(position=0))
        yield generation_pb2.GenerateEvent(
            job_id=request.job_id, progress=generation_pb2.StageProgress(stage="dit", step=1, total=1)
        )
        offset = 0
        while context.is_active():
            data = b"\0" * MIB
            chunk = generation_pb2.EncodedChunk(media_type="video/mp4", offset=offset, data=data)
            yield generation_pb2.GenerateEvent(job_id=request.job_id, result=generation_pb2.ResultChunk(encoded=chunk))
            offset += len(data)
            self.result_chunks_sent += 1
            if request.job_id == "slow":
                while context.is_active():
                    time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _gateway(orchestrator_port: int, log: Path, *flags: str) -> Iterator[tuple[int, subprocess.Popen]]:
    """(port, process) of a gateway started as `stagediff serve http` with `flags`; its temp files in log's folder."""
    port = _free_port()
    command = "from services.gateway.service import main; main()"
    argv = ["--port", str(port), "--orchestrator", f"127.0.0.1:{orchestrator_port}", *flags]
    env = {**os.environ, "TMPDIR": str(log.parent)}
    with log.open("w") as output:
        process = subprocess.Popen([sys.executable, "-c", command, *argv], stdout=output, stderr=output, env=env)
    try:
        deadline = time.monotonic() + 30
        while _status(port, "GET", "/healthz")[0] != 200:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield port, process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _status(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, body) of one request; (0, b"") when nothing answers."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        answer = connection.getresponse()
        return answer.status, answer.read()
    except OSError:
        return 0, b""
    finally:
        connection.close()


@pytest.fixture(scope="module")
def orchestrator() -> Iterator[tuple[int, FakeOrchestrator]]:
    servicer = FakeOrchestrator()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(None)


@pytest.fixture(scope="module")
def gateway(orchestrator, tmp_path_factory) -> Iterator[tuple[int, subprocess.Popen, Path]]:
    """A gateway with its defaults; its temp folder."""
    folder = tmp_path_factory.mktemp("gateway")
    with _gateway(orchestrator[0], folder / "log") as (port, process):
        yield port, process, folder


def _memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _temp_files(pid: int, folder: Path) -> list[str]:
    """The files the process has open in `folder` (its TMPDIR): spooled uploads, named or not."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith(str(folder)) and not target.endswith("/log"):
                found.append(target)
    return found


def _closed_by_server(sockets: list[socket.socket], within_s: float) -> int:
    """How many of `sockets` the server closed within `within_s` (the peer's EOF or reset)."""
    closed: set[int] = set()
    deadline = time.monotonic() + within_s
    for sock in sockets:
        sock.setblocking(False)
    while len(closed) < len(sockets) and time.monotonic() < deadline:
        for index, sock in enumerate(sockets):
            if index in closed:
                continue
            try:
                if sock.recv(65536) == b"":
                    closed.add(index)
            except BlockingIOError:
                pass
            except OSError:
                closed.add(index)
        time.sleep(0.2)
    return len(closed)


def test_idle_and_half_sent_connections_are_closed_while_healthz_answers(gateway) -> None:
    """1,100 silent connections (more than --max-concurrent-requests) and 30 with half a request's headers or a
    body without a key: /healthz still answers 200, and the server has closed every one within 30 s."""
    port = gateway[0]
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(1100)]
    half_headers = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(15)]
    for sock in half_headers:
        sock.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n")
    half_bodies = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(15)]
    for sock in half_bodies:
        sock.sendall(b'POST /v1/videos HTTP/1.1\r\nHost: gateway\r\nContent-Length: 1000\r\n\r\n{"prompt": ')
    try:
        started = time.monotonic()
        assert _status(port, "GET", "/healthz")[0] == 200
        assert time.monotonic() - started < 10
        every = sockets + half_headers + half_bodies
        assert _closed_by_server(every, within_s=30) == len(every)
    finally:
        for sock in sockets + half_headers + half_bodies:
            sock.close()


def test_a_slow_body_with_a_key_is_closed_at_the_body_deadline(orchestrator, tmp_path) -> None:
    """A caller with a key who sends half a body: closed once --body-timeout has passed, not held."""
    with _gateway(orchestrator[0], tmp_path / "log", "--body-timeout", "1", "--header-timeout", "1") as (port, _):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        head = f"POST /v1/videos HTTP/1.1\r\nHost: g\r\nAuthorization: {KEY}\r\nContent-Type: application/json\r\n"
        sock.sendall(f'{head}Content-Length: 1000\r\n\r\n{{"prompt": '.encode())
        assert _closed_by_server([sock], within_s=10) == 1
        sock.close()


def _multipart_head(length: int, authorization: str | None) -> bytes:
    head = (
        "POST /v1/videos HTTP/1.1\r\nHost: gateway\r\n"
        "Content-Type: multipart/form-data; boundary=XyZ\r\n"
        f"Content-Length: {length}\r\n"
    )
    if authorization:
        head += f"Authorization: {authorization}\r\n"
    part = 'Content-Disposition: form-data; name="input_reference"; filename="a.png"\r\n'
    return (head + "\r\n" + "--XyZ\r\n" + part + "Content-Type: image/png\r\n\r\n").encode()


def test_unfinished_uploads_without_a_key_get_401_before_the_body_and_leave_no_temp_files(gateway) -> None:
    port, process, folder = gateway
    uploads = []
    try:
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            uploads.append(sock)
            sock.sendall(_multipart_head(8 * MIB, None))
            with contextlib.suppress(OSError):  # the server may close before it has taken these
                sock.sendall(b"\x89PNG" + b"\0" * (3 * MIB))
        for sock in uploads:
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert _temp_files(process.pid, folder) == []
    finally:
        for sock in uploads:
            sock.close()
    # With a key, an upload spools to disk; when its caller goes away, its temp file goes with it.
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(_multipart_head(8 * MIB, KEY) + b"\x89PNG" + b"\0" * (3 * MIB))
    deadline = time.monotonic() + 10
    while not _temp_files(process.pid, folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    sock.close()
    deadline = time.monotonic() + 10
    while _temp_files(process.pid, folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _temp_files(process.pid, folder) == []


def _send_json(port: int, body: bytes, chunked: bool, authorization: str | None = None) -> int:
    """The status of a JSON POST whose body the server may refuse before taking it all (0 if none came)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    try:
        if chunked:
            pieces = (body[start : start + MIB] for start in range(0, len(body), MIB))
            connection.request("POST", "/v1/videos", body=pieces, headers=headers, encode_chunked=True)
        else:
            connection.request("POST", "/v1/videos", body=body, headers=headers)
    except OSError:
        pass  # refused midway: the answer was sent already
    try:
        return connection.getresponse().status
    except OSError:
        return 0
    finally:
        connection.close()


def test_a_64_mib_json_without_a_key_is_refused_unparsed(gateway) -> None:
    """{"a":[{},{},...]} of 64 MiB, with its length and chunked: 401 or 413, and the gateway's peak memory
    grows by less than the body's size (parsed, it takes over a GiB)."""
    port, process, _ = gateway
    items = (64 * MIB - 8) // 3
    body = b'{"a":[' + b"{}," * (items - 1) + b"{}]}"
    body += b" " * (64 * MIB - len(body))
    Path(f"/proc/{process.pid}/clear_refs").write_text("5")  # VmHWM from now on
    before = _memory_kib(process.pid, "VmRSS")
    for chunked in (False, True):
        assert _send_json(port, body, chunked) in (401, 413)
    assert (_memory_kib(process.pid, "VmHWM") - before) * 1024 < 64 * MIB
    assert _status(port, "GET", "/healthz")[0] == 200


def test_deeply_nested_json_is_400(gateway) -> None:
    port = gateway[0]
    body = b'{"prompt": "x", "input_reference": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, answer = _status(
        port, "POST", "/v1/videos", body, {"Content-Type": "application/json", "Authorization": KEY}
    )
    assert status == 400, answer[:300]
    assert json.loads(answer)["error"]["param"] == "body"
    status, answer = _status(
        port, "POST", "/v1/videos", b"\xff\xfe{", {"Content-Type": "application/json", "Authorization": KEY}
    )
    assert status == 400, answer[:300]


def test_a_raw_jobs_download_is_409_with_a_hint(gateway) -> None:
    status, answer = _status(gateway[0], "GET", "/v1/videos/raw/content", headers={"Authorization": KEY})
    assert status == 409, answer[:300]
    error = json.loads(answer)["error"]
    assert error["code"] == "raw_result" and "output_format mp4" in error["message"] and "gRPC" in error["message"]


def test_the_newest_page_of_videos_asks_only_for_that_page(gateway, orchestrator) -> None:
    """GET /v1/videos asks the orchestrator for limit + 1 jobs (the one more says has_more), not its whole window;
    a cursor or the oldest first still needs the window."""
    listed = orchestrator[1].list_limits
    status, answer = _status(gateway[0], "GET", "/v1/videos?limit=2", headers={"Authorization": KEY})
    assert status == 200, answer[:300]
    page = json.loads(answer)
    assert [video["id"] for video in page["data"]] == ["c", "b"] and page["has_more"] is True
    assert listed[-1] == 3
    status, answer = _status(gateway[0], "GET", "/v1/videos?limit=2&after=c", headers={"Authorization": KEY})
    assert [video["id"] for video in json.loads(answer)["data"]] == ["b", "a"] and listed[-1] == 100


def test_downloads_per_key_are_bounded(gateway) -> None:
    """Four downloads of a never-ending file are open: the fifth is 429 with Retry-After; once one ends, the
    next is served."""
    port = gateway[0]
    open_downloads = []
    try:
        for _ in range(4):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/v1/videos/slow/content", headers={"Authorization": KEY})
            answer = connection.getresponse()
            assert answer.status == 200
            answer.read(1024)
            open_downloads.append(connection)
        status, answer = _status(port, "GET", "/v1/videos/slow/content", headers={"Authorization": KEY})
        assert status == 429 and json.loads(answer)["error"]["code"] == "too_many_downloads"
        open_downloads.pop().close()
        deadline = time.monotonic() + 10
        while True:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/v1/videos/slow/content", headers={"Authorization": KEY})
            status = connection.getresponse().status
            open_downloads.append(connection)
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == 200
    finally:
        for connection in open_downloads:
            connection.close()


def test_the_progress_stream_does_not_read_the_result(gateway, orchestrator) -> None:
    """The job's WatchJob would send result chunks for ever: the stream stops at the first, and ends with
    completed from GetJob."""
    servicer = orchestrator[1]
    sent_before = servicer.result_chunks_sent
    connection = http.client.HTTPConnection("127.0.0.1", gateway[0], timeout=10)
    connection.request("GET", "/v1/videos/endless/events", headers={"Authorization": KEY})
    answer = connection.getresponse()
    assert answer.status == 200
    text = answer.read().decode()  # ends when the stream ends
    connection.close()
    assert "event: queued" in text and "event: progress" in text and "event: completed" in text
    assert servicer.result_chunks_sent - sent_before < 64  # what gRPC's flow-control window holds at most


def test_docs_are_not_served(gateway) -> None:
    port = gateway[0]
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert _status(port, "GET", path)[0] == 401  # no key: nothing is served but /healthz and /readyz
        assert _status(port, "GET", path, headers={"Authorization": KEY})[0] == 404  # off by default


def test_refusals_are_logged_at_a_bounded_rate(gateway) -> None:
    """50 requests without a key: each is 401, and the log has one or two lines for them, not 50."""
    port, _, folder = gateway
    log = folder / "log"
    time.sleep(REFUSAL_LOG_INTERVAL_S + 0.1)  # past the interval of a refusal an earlier test caused
    before = log.read_text().count("refused an HTTP request")
    for _ in range(50):
        assert _status(port, "GET", "/v1/models")[0] == 401
    assert 1 <= log.read_text().count("refused an HTTP request") - before <= 2
