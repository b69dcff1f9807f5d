"""The HTTP gateway end to end, through OpenAI's own Python client and through curl, on the shared local cluster
(`stagediff up`'s processes: the stages, the orchestrator, and the gateway in front of it).

A video made over HTTP is the orchestrator's job (watched over gRPC too), its content a playable MP4 of the
frame count, size and frame rate asked for; an image made over HTTP is the PNG of the frame gRPC makes for the
same request; the models are the orchestrator's. The flows with curl, including the server-sent progress
stream and a multipart upload, are in http_flows.sh.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import openai
import pytest
from PIL import Image

from stagediff.client import Client

# OpenAI marks its videos API deprecated for its own service; the routes are the convention we serve.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]

VIDEO = {"num_frames": 9, "fps": 8, "num_inference_steps": 2, "seed": 11}


def _openai(cluster) -> openai.OpenAI:
    # No retries of the client's own: a status must reach the test as the gateway gave it.
    return openai.OpenAI(api_key="unused", base_url=f"{cluster.http_url}/v1", max_retries=0, timeout=120)


def _wait_completed(client: openai.OpenAI, video_id: str, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while True:
        video = client.videos.retrieve(video_id)
        assert video.status in ("queued", "in_progress", "completed"), video
        if video.status == "completed":
            return video
        assert time.monotonic() < deadline, f"video {video_id} still {video.status}"
        time.sleep(0.2)


def test_openai_videos_create_retrieve_download_and_delete(cluster) -> None:
    client = _openai(cluster)
    created = client.videos.create(prompt="a red circle moving right", size="64x64", extra_body=VIDEO)
    assert created.status in ("queued", "in_progress") and created.size == "64x64"
    # The same job over gRPC: its id is the orchestrator's.
    with Client(cluster.endpoint) as grpc_client:
        assert grpc_client.get_job(created.id).request.output_format == "mp4"
    video = _wait_completed(client, created.id)
    assert video.progress == 100 and video.seconds == "1.12"  # 9 frames at 8 fps

    content = client.videos.download_content(created.id).read()
    with av.open(io.BytesIO(content)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        assert stream.average_rate == 8
    assert len(frames) == 9 and frames[0].shape == (64, 64, 3)

    assert created.id in [listed.id for listed in client.videos.list(limit=100)]
    deleted = client.videos.delete(created.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError) as error:
        client.videos.retrieve(created.id)
    assert error.value.status_code == 404


def test_a_grpc_job_is_a_video_over_http(cluster) -> None:
    """A job submitted over gRPC for raw frames is retrieved over HTTP (progress 100, its size); its content is
    not encoded on every download: a 409 says to read the frames over gRPC or to submit for MP4. Its prompt is
    longer than the text encoder takes: the result, the job and the video object say it was truncated."""
    prompt = "a red circle " + "moving right and growing slowly " * 50
    with Client(cluster.endpoint) as grpc_client:
        job = grpc_client.submit(prompt, height=64, width=64, **VIDEO)
        result = grpc_client.wait(job.job_id)
        notices = list(grpc_client.get_job(job.job_id).notices)
    assert [(notice.field, notice.used, notice.source) for notice in notices] == [
        ("prompt", "512 tokens", "text-encoder")
    ]
    assert notices[0].message.startswith("the prompt was truncated to 512 tokens (")
    assert [notice.message for notice in result.notices] == [notices[0].message]
    client = _openai(cluster)
    video = _wait_completed(client, job.job_id)
    assert (video.progress, video.size) == (100, "64x64")
    assert [notice["message"] for notice in video.model_dump()["notices"]] == [notices[0].message]
    with pytest.raises(openai.ConflictError) as refused:
        client.videos.download_content(job.job_id)
    assert refused.value.body["code"] == "raw_result" and "output_format mp4" in refused.value.body["message"]


def test_openai_images_generate_equals_the_grpc_frame(cluster) -> None:
    request = dict(num_inference_steps=2, guidance_scale=1.0, seed=5)
    response = _openai(cluster).images.generate(
        prompt="a blue square", size="64x64", n=2, response_format="b64_json", extra_body=request
    )
    assert len(response.data) == 2
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json)))) for item in response.data]
    with Client(cluster.endpoint) as grpc_client:
        for index, image in enumerate(images):
            result = grpc_client.generate(
                "a blue square", height=64, width=64, num_frames=1, **{**request, "seed": 5 + index}
            )
            assert np.array_equal(image, result.frames[0])
    assert not np.array_equal(images[0], images[1])  # seeds 5 and 6


def test_openai_models_list_and_typed_errors(cluster) -> None:
    client = _openai(cluster)
    with Client(cluster.endpoint) as grpc_client:
        served = [model.id for model in grpc_client.list_models()]
    assert [model.id for model in client.models.list()] == served
    with pytest.raises(openai.BadRequestError) as error:  # the orchestrator's refusal, naming the field
        client.images.generate(prompt="a square", size="65x64")
    assert error.value.status_code == 400 and error.value.body["param"] == "width"
    with pytest.raises(openai.BadRequestError) as error:  # the gateway's own, naming the field
        client.images.generate(prompt="a square", extra_body={"num_inference_step": 2})
    assert error.value.body["param"] == "num_inference_step"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("no-such-job")


def test_the_flows_with_curl(cluster) -> None:
    """curl is part of the test environment: a machine without it fails here rather than skipping the flows."""
    assert shutil.which("curl") is not None, "the HTTP flows are tested with curl; install it"
    script = Path(__file__).with_name("http_flows.sh")
    result = subprocess.run(
        ["bash", str(script), cluster.http_url],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NUM_FRAMES": "5", "PY": sys.executable},
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "event: progress" in result.stdout and "event: completed" in result.stdout
