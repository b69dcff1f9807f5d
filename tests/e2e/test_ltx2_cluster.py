"""LTX-2 through one running cluster, its video and its sound, against LTX2Pipeline on the tiny checkpoint
(LTX-2.3's layout: a 48 kHz vocoder): the frames within one level of the pipeline's and the waveform within
AUDIO_TOLERANCE of its own audio output (raw results over gRPC); an mp4 with an AAC stream of the sound's rate,
channels and duration whose samples are the pipeline's within the coding noise, from the SDK and from the HTTP
gateway through the official `openai` package; frame interpolation doubling the frames and the frame rate while
the sound stays the pipeline's, as long as the video; and a silent mp4 on request. The image-to-video checkpoint
(`ltx-2-i2v`, the same weights) is served beside it: an image sent as the first frame gives
LTX2ImageToVideoPipeline's frames and sound, interpolated.

How the stages carry the sound (the DiT's "audio_latents", the VAE's "audio") and every refusal on the way are
in tests/integration/test_ltx2_stages.py; the orchestrator's handling of the sound (past the interpolator, into
the store, counted, replayed, muxed) in tests/unit/test_result_audio.py.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import openai
import pytest
import torch

from families.ltx2.family import LTX2_I2V
from stagediff import Client
from stagediff.local.supervisor import LocalCluster
from stagekit.denoise import DenoiseSpec
from tests.helpers.ltx2 import (
    NEGATIVE,
    PROMPT,
    PipelineRun,
    compare_frames,
    reference_pipeline,
    run_pipeline,
    tiny_checkpoint,
)
from tests.helpers.serving import THREADS_PER_STAGE
from tests.helpers.wan_i2v import input_image

pytestmark = pytest.mark.e2e

# 64x96 pixels, 17 frames (0.71 s at 24 fps), 2 steps with CFG (the audio guidance always runs it).
SPEC = DenoiseSpec(height=64, width=96, num_frames=17, num_inference_steps=2, guidance_scale=3.0, seed=7)
ARGUMENTS = dict(
    model="ltx-2",
    negative_prompt=NEGATIVE,
    height=SPEC.height,
    width=SPEC.width,
    num_frames=SPEC.num_frames,
    num_inference_steps=SPEC.num_inference_steps,
    guidance_scale=SPEC.guidance_scale,
    seed=SPEC.seed,
)
RATE = 48_000  # the tiny checkpoint's LTX2VocoderWithBWE
# The stages compute the pipeline's waveform to float rounding (tests/integration/test_ltx2_stages.py); the wire
# carries float32 as it is.
AUDIO_TOLERANCE = 1e-5
# AAC at its default 128 kbit/s keeps the waveform this far above its coding noise. The tiny checkpoint's random
# weights make a noise-like sound whose energy reaches 24 kHz, above AAC's band limit: 6.4 dB measured (a
# correlation of 0.9 with the pipeline's samples, against 0 for another sound); the sweeps of
# tests/unit/test_encoded_results.py keep 26 dB.
MIN_AAC_SNR_DB = 5.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint, served under the id "ltx-2" (its directory's name)."""
    given = tiny_checkpoint("tiny", tmp_path_factory)
    return Path(shutil.copytree(given, tmp_path_factory.mktemp("ltx2-served") / "ltx-2"))


@pytest.fixture(scope="module")
def i2v_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint as LTX2ImageToVideoPipeline's, served under the id "ltx-2-i2v"."""
    given = tiny_checkpoint("tiny", tmp_path_factory, LTX2_I2V)
    return Path(shutil.copytree(given, tmp_path_factory.mktemp("ltx2-i2v-served") / "ltx-2-i2v"))


@pytest.fixture(scope="module")
def reference(model: Path) -> PipelineRun:
    return run_pipeline(reference_pipeline(model), SPEC)


@pytest.fixture(scope="module")
def cluster(model: Path, i2v_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(
        [model, i2v_model], threads_per_stage=THREADS_PER_STAGE, log_dir=tmp_path_factory.mktemp("ltx2-logs")
    )
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


def _pipeline_sound(reference: PipelineRun) -> np.ndarray:
    """The pipeline's waveform, float32 [channels, samples]."""
    return reference.output.audio[0].float().numpy()


def _check_mp4_sound(data: bytes, expected: np.ndarray, label: str) -> None:
    """The file's AAC stream has the sound's rate and channels and all of its samples (the encoder's priming frame
    and padding aside), they are the pipeline's above the coding noise (aligned by cross-correlation), and they
    start with the video's first frame (the muxer delays both streams by the video encoder's reordering)."""
    with av.open(io.BytesIO(data)) as container:
        (video,) = container.streams.video
        first_frame = float(next(container.decode(video)).time)
    with av.open(io.BytesIO(data)) as container:
        (stream,) = container.streams.audio
        codec, rate, channels = stream.codec_context.name, stream.rate, stream.channels
        decoded_frames = list(container.decode(stream))
    assert (codec, rate, channels) == ("aac", RATE, expected.shape[0]), (codec, rate, channels)
    decoded = np.concatenate([frame.to_ndarray() for frame in decoded_frames], axis=1)
    priming = decoded_frames[0].samples
    assert 0 <= decoded.shape[1] - priming - expected.shape[1] < 1024, (decoded.shape, priming, expected.shape)
    window = expected[0, : RATE // 20]
    offset = max(range(0, 4096), key=lambda k: float(np.dot(decoded[0, k : k + window.size], window)))
    aligned = decoded[:, offset : offset + expected.shape[1] - 2048]
    part = expected[:, : aligned.shape[1]]
    snr = 10 * np.log10(np.mean(part**2) / np.mean((aligned - part) ** 2))
    # Where the sound starts on the file's timeline: the decoded frame holding sample `offset`, and the way into it.
    index = 0
    for frame in decoded_frames:
        if offset < index + frame.samples:
            start = float(frame.time) + (offset - index) / rate
            break
        index += frame.samples
    print(
        f"{label}: {codec} at {rate} Hz, {decoded.shape[1]} samples decoded for {expected.shape[1]}; the sound starts "
        f"at {start:.4f} s, the video at {first_frame:.4f} s; {snr:.1f} dB above the coding noise"
    )
    assert snr >= MIN_AAC_SNR_DB, snr
    assert abs(start - first_frame) <= 1e-3, (start, first_frame)


def test_raw_frames_and_sound_equal_the_pipeline(cluster: LocalCluster, reference: PipelineRun) -> None:
    with Client(cluster.endpoint) as client:
        listed = {model.id: model for model in client.list_models()}
        result = client.generate(PROMPT, output_format="raw", **ARGUMENTS)
    assert set(listed) == {"ltx-2", "ltx-2-i2v"}
    for model in listed.values():
        assert (model.limits.audio_sample_rate, model.limits.audio_channels) == (RATE, 2), model.id
    compare_frames("cluster", torch.from_numpy(result.frames), reference.output.frames[0])
    expected = _pipeline_sound(reference)
    assert result.audio is not None and result.audio_sample_rate == RATE
    assert result.audio.dtype == np.float32 and result.audio.shape == expected.shape
    difference = float(np.abs(result.audio - expected).max())
    print(f"cluster: sound {expected.shape} at {RATE} Hz, max abs diff {difference:.2e} from the pipeline's")
    assert difference <= AUDIO_TOLERANCE and float(np.abs(expected).max()) > 0.01


def test_an_mp4_carries_the_sound_as_aac(cluster: LocalCluster, reference: PipelineRun) -> None:
    with Client(cluster.endpoint) as client:
        result = client.generate(PROMPT, output_format="mp4", **ARGUMENTS)
        silent = client.generate(PROMPT, output_format="mp4", audio_codec="none", **ARGUMENTS)
    assert result.media_type == "video/mp4" and result.data is not None
    _check_mp4_sound(result.data, _pipeline_sound(reference), "sdk mp4")
    assert silent.data is not None
    with av.open(io.BytesIO(silent.data)) as container:
        assert not container.streams.audio and len(container.streams.video) == 1


def test_the_http_gateway_serves_the_mp4_with_its_sound(cluster: LocalCluster, reference: PipelineRun) -> None:
    http = openai.OpenAI(api_key="unused", base_url=f"{cluster.http_url}/v1", max_retries=0, timeout=120)
    fields = {key: value for key, value in ARGUMENTS.items() if key not in ("model", "height", "width")}
    video = http.videos.create_and_poll(
        model="ltx-2", prompt=PROMPT, size=f"{SPEC.width}x{SPEC.height}", extra_body=fields
    )
    assert video.status == "completed", video
    data = http.videos.download_content(video.id).read()
    assert data[4:8] == b"ftyp"
    _check_mp4_sound(data, _pipeline_sound(reference), "http mp4")


def test_interpolation_doubles_the_frames_and_keeps_the_sound(cluster: LocalCluster, reference: PipelineRun) -> None:
    """Interpolated frames change the frame rate, never the video's length: the sound is the pipeline's."""
    with Client(cluster.endpoint) as client:
        result = client.generate(PROMPT, output_format="raw", interp_exp=1, **ARGUMENTS)
    assert result.frames.shape[0] == 2 * SPEC.num_frames - 1 and result.fps == 48.0
    expected = _pipeline_sound(reference)
    assert result.audio is not None and result.audio.shape == expected.shape
    assert float(np.abs(result.audio - expected).max()) <= AUDIO_TOLERANCE


def test_image_to_video_beside_text_to_video_equals_the_pipeline(cluster: LocalCluster, i2v_model: Path) -> None:
    """A 100x70 image sent as the first frame of "ltx-2-i2v" (resized to the request's 96x64 by its VAE stage's
    Encode) gives LTX2ImageToVideoPipeline's frames within one level and its sound, interpolated: the decoded frames
    stay in place between the interpolated ones, the sound is as long as the video."""
    frame = input_image(100, 70, 3)
    reference = run_pipeline(reference_pipeline(i2v_model, image_to_video=True), SPEC, image=frame)
    arguments = {**ARGUMENTS, "model": "ltx-2-i2v"}
    with Client(cluster.endpoint) as client:
        result = client.generate(PROMPT, image=frame, output_format="raw", interp_exp=1, **arguments)
        job = client.get_job(result.job_id)
    assert job.timings["vae-encode"] > 0
    assert result.frames.shape[0] == 2 * SPEC.num_frames - 1 and result.fps == 48.0
    compare_frames("image-to-video cluster", torch.from_numpy(result.frames[::2].copy()), reference.output.frames[0])
    expected = _pipeline_sound(reference)
    assert result.audio is not None and result.audio.shape == expected.shape
    difference = float(np.abs(result.audio - expected).max())
    print(f"image-to-video cluster: sound max abs diff {difference:.2e} from the pipeline's")
    assert difference <= AUDIO_TOLERANCE and float(np.abs(expected).max()) > 0.01
