"""Encoded results in the SDK: the file's chunks assembled and checked, frames decoded only when asked for, save()
writing the file as it is or re-encoding its frames; and the request keywords (output format and the others) that
every generate method takes (RequestOptions)."""

from __future__ import annotations

import inspect
from pathlib import Path

import grpc
import numpy as np
import pytest

from stagediff import results as results_module
from stagediff.client import (
    AsyncClient,
    BytesReceived,
    Client,
    FramesReceived,
    GenerationResult,
    InternalError,
    RequestOptions,
    build_request,
)
from stagediff.media import load_npz, save_frames
from stagediff.v1 import generation_pb2_grpc
from tests.helpers.fake_client_server import FakeServer
from tests.helpers.sdk_events import IMAGE, encoded_events, png_bytes

# Flat colours survive lossy coding within a few levels.
VIDEO = np.stack([np.full((16, 16, 3), value, np.uint8) for value in (40, 120, 200)])


def mp4_bytes(tmp_path: Path) -> bytes:
    return save_frames(tmp_path / "made.mp4", VIDEO, 8).read_bytes()


class Replaying(generation_pb2_grpc.GenerationServicer):
    """Answers every Generate with the same events; keeps the last request."""

    def __init__(self, events) -> None:
        self.events = events
        self.request = None

    async def Generate(self, request, context):
        self.request = request
        for event in self.events:
            yield event


@pytest.fixture
def serve():
    servers: list[FakeServer] = []

    def make(events) -> FakeServer:
        servers.append(FakeServer(Replaying(events)))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def decodes(monkeypatch) -> list[str]:
    """The media types decoded to frames, in order."""
    seen: list[str] = []
    decode = results_module.decode_media

    def counting(data: bytes, media_type: str) -> np.ndarray:
        seen.append(media_type)
        return decode(data, media_type)

    monkeypatch.setattr(results_module, "decode_media", counting)
    return seen


def test_an_encoded_mp4_is_assembled_and_decoded_on_first_access(serve, decodes, tmp_path: Path) -> None:
    data = mp4_bytes(tmp_path)
    server = serve(encoded_events(data, "video/mp4", num_frames=3))
    with Client(f"127.0.0.1:{server.port}") as client:
        events = list(client.stream("a fox", output_format="mp4", output_quality=70))
    received = [event for event in events if isinstance(event, BytesReceived)]
    assert len(received) == 3 and received[0].offset == 0
    assert sum(event.count for event in received) == len(data)
    assert all(
        earlier.offset + earlier.count == later.offset for earlier, later in zip(received, received[1:], strict=False)
    )
    result = events[-1]
    assert isinstance(result, GenerationResult)
    assert (result.data, result.media_type, result.seed, result.num_frames) == (data, "video/mp4", 42, 3)
    assert server.servicer.request.output_format == "mp4" and server.servicer.request.output_quality == 70
    assert decodes == [], "nothing is decoded until the frames are asked for"
    assert result.frames.shape == VIDEO.shape and np.abs(result.frames.astype(int) - VIDEO).max() <= 3
    result.frames  # noqa: B018 - a second access decodes nothing more
    assert decodes == ["video/mp4"]


def test_save_writes_the_file_as_it_is_or_its_frames(serve, tmp_path: Path) -> None:
    data = mp4_bytes(tmp_path)
    server = serve(encoded_events(data, "video/mp4", num_frames=3))
    with Client(f"127.0.0.1:{server.port}") as client:
        result = client.generate("a fox", output_format="mp4")
    assert result.save(tmp_path / "out" / "fox.MP4").read_bytes() == data
    frames, fps = load_npz(result.save(tmp_path / "fox.npz"))
    assert frames.shape == VIDEO.shape and fps == 8
    with pytest.raises(ValueError, match=r"path: extension '\.webm' is not allowed.*\.mp4, \.png, \.npz"):
        result.save(tmp_path / "fox.webm")


def test_an_encoded_png_saves_as_is_and_decodes_exactly(serve, tmp_path: Path) -> None:
    data = png_bytes()
    server = serve(encoded_events(data, "image/png", pieces=2))
    with Client(f"127.0.0.1:{server.port}") as client:
        result = client.generate("a fox", output_format="png", num_frames=1)
    assert result.save(tmp_path / "fox.png").read_bytes() == data
    assert np.array_equal(result.frames, IMAGE)
    assert np.array_equal(load_npz(result.save(tmp_path / "fox.npz"))[0], IMAGE)
    with pytest.raises(ValueError, match="path: extension '.jpg'"):
        result.save(tmp_path / "fox.jpg")


def test_raw_frames_kept_beside_the_file_are_used_without_decoding(serve, decodes, tmp_path: Path) -> None:
    data = png_bytes()
    server = serve(encoded_events(data, "image/png", raw=IMAGE))
    with Client(f"127.0.0.1:{server.port}") as client:
        events = list(client.stream("a fox", output_format="png", keep_raw_frames=True))
    assert {FramesReceived, BytesReceived} <= {type(event) for event in events}
    result = events[-1]
    assert np.array_equal(result.frames, IMAGE) and result.data == data and decodes == []
    assert server.servicer.request.keep_raw_frames


def test_a_gap_in_the_file_is_data_loss(serve) -> None:
    events = encoded_events(png_bytes(), "image/png", pieces=3)
    del events[2]  # the second chunk
    server = serve(events)
    with Client(f"127.0.0.1:{server.port}") as client, pytest.raises(InternalError) as raised:
        client.generate("a fox", output_format="png")
    assert raised.value.code == grpc.StatusCode.DATA_LOSS and "missing" in raised.value.message


def test_a_file_of_another_size_than_reported_is_data_loss(serve) -> None:
    data = png_bytes()
    server = serve(encoded_events(data, "image/png", encoded_bytes=len(data) + 1))
    with Client(f"127.0.0.1:{server.port}") as client, pytest.raises(InternalError) as raised:
        client.generate("a fox", output_format="png")
    assert raised.value.code == grpc.StatusCode.DATA_LOSS
    assert raised.value.message == f"encoded result: received {len(data)} bytes, the server reported {len(data) + 1}"


def test_a_result_built_from_frames_keeps_its_old_form(tmp_path: Path) -> None:
    result = GenerationResult("j", VIDEO, 8.0, {"total": 1.0}, passes_run=4)
    assert result.frames is VIDEO and result.num_frames == 3 and result.data is None and result.media_type == ""
    assert load_npz(result.save(tmp_path / "x.npz"))[0].shape == VIDEO.shape
    with pytest.raises(ValueError, match="frames: give the frames, or data"):
        GenerationResult("j")


def test_build_request_sets_the_output_fields_and_always_a_request_id() -> None:
    request = build_request("a fox", output_format="webp", output_quality=80, keep_raw_frames=True, request_id="")
    assert (request.output_format, request.output_quality, request.keep_raw_frames) == ("webp", 80, True)
    assert request.request_id, "an empty request id is replaced by a generated one"
    plain = build_request("a fox")
    assert plain.output_format == "" and not plain.HasField("output_quality") and not plain.keep_raw_frames


@pytest.mark.parametrize(
    "method",
    [AsyncClient.stream, AsyncClient.generate, AsyncClient.submit, Client.stream, Client.generate, Client.submit],
)
def test_every_generate_method_takes_the_request_keywords(method) -> None:
    """Each method takes RequestOptions' keywords (typed for editors and type checkers), as build_request does."""
    options = [p for p in inspect.signature(method).parameters.values() if p.kind == inspect.Parameter.VAR_KEYWORD]
    assert [option.annotation for option in options] == ["Unpack[RequestOptions]"]
    assert "output_format" in RequestOptions.__annotations__ and "seed" in RequestOptions.__annotations__


def test_an_unknown_keyword_is_refused_naming_it_its_close_match_and_every_keyword() -> None:
    with pytest.raises(TypeError) as refused:
        build_request("a fox", num_inference_step=4, colour="red")
    message = str(refused.value)
    assert message.startswith(
        "unknown keywords 'colour', 'num_inference_step' (did you mean 'num_inference_steps'?); the request "
        "keywords are audio_codec, cache, cache_threshold, deadline_s, embedded_guidance_scale, fps, guidance_scale,"
    )
    assert "RequestOptions'" not in message and message.endswith("seed, width")
