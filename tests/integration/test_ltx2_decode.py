"""LTX-2's VAE stage (families/ltx2/decode.py) against LTX2Pipeline, on tiny checkpoints in both published layouts
("tiny": LTX-2.3's, "tiny-2.0": LTX-2.0's, families/ltx2/init_model.py).

From one prompt and seed, the family's text encoder, denoiser and decoder give the frames of
`LTX2Pipeline(output_type="np")` within one uint8 level, and its waveform (`audio`) within float rounding, at the
vocoder's sample rate and length; a session fed one latent frame at a time returns no frames until the last and
then the whole decode; a timestep-conditioned VAE is decoded at the pipeline's decode_timestep. Why the session
does not stream: with the published decoders' block layouts (at narrow widths), the first frame of a 121-frame
video depends on the 15th (LTX-2.3) or the last (LTX-2.0) of its 16 latent frames.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLLTX2Video, LTX2Pipeline

from families.ltx2.decode import LTX2Decoder
from families.ltx2.denoise import LTX2Denoiser
from stagekit.denoise import DenoiseSpec
from tests.helpers.ltx2 import (
    CPU,
    FRAME_RATE,
    compare_frames,
    conditioning,
    reference_pipeline,
    run_pipeline,
    tiny_checkpoint,
)

# 64x96 pixels: 2x3 latents; 17 frames: 3 latent frames (1 + 8 + 8 frames), 18 audio latent frames at 24 fps.
SPEC = DenoiseSpec(height=64, width=96, num_frames=17, num_inference_steps=2, guidance_scale=3.0, seed=7)
# The waveform is a few float32 ops from the latents, which the denoiser gives within 1e-5 of the pipeline's; the
# vocoder ends in tanh (LTX-2.0) or a clamp to [-1, 1] (LTX-2.3), so differences do not grow past that.
WAVEFORM_TOLERANCE = 1e-5
# Each layout's vocoder: (samples per mel frame at its output rate, output sample rate).
VOCODERS = {"tiny": (160 * 3, 48_000), "tiny-2.0": (240, 24_000)}


@pytest.fixture(scope="module", autouse=True)
def _two_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["tiny", "tiny-2.0"])
def preset(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(preset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(preset, tmp_path_factory)


@pytest.fixture(scope="module")
def pipeline(model: Path) -> LTX2Pipeline:
    return reference_pipeline(model)


@pytest.fixture(scope="module")
def expected(pipeline: LTX2Pipeline) -> Any:
    return run_pipeline(pipeline, SPEC).output


@pytest.fixture(scope="module")
def latents(model: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's text encoder and denoiser: the (video, audio) latents the DiT stage sends to the VAE stage."""
    return LTX2Denoiser(model, CPU, torch.float32).denoise_av(
        SPEC, conditioning(model), on_step=lambda step, total: None, cancelled=lambda: False
    )


@pytest.fixture(scope="module")
def decoder(model: Path) -> LTX2Decoder:
    return LTX2Decoder(model, CPU, torch.float32)


def test_frames_equal_pipeline(
    preset: str, decoder: LTX2Decoder, latents: tuple[torch.Tensor, torch.Tensor], expected: Any
) -> None:
    video_latents, _ = latents
    assert video_latents.shape == (1, 8, 3, 2, 3)
    start = time.perf_counter()
    frames = decoder.decode_video(video_latents)
    print(f"{preset}: video decode {time.perf_counter() - start:.3f} s")
    assert frames.shape == (SPEC.num_frames, SPEC.height, SPEC.width, 3)
    compare_frames(preset, frames, expected.frames[0])


def test_waveform_equals_pipeline(
    preset: str, decoder: LTX2Decoder, latents: tuple[torch.Tensor, torch.Tensor], expected: Any
) -> None:
    _, audio_latents = latents
    start = time.perf_counter()
    waveform, sample_rate = decoder.decode_audio(audio_latents)
    seconds_taken = time.perf_counter() - start
    samples_per_mel_frame, rate = VOCODERS[preset]
    audio_frames = audio_latents.shape[2]
    mel_frames = 4 * audio_frames - 3  # the audio VAE's causal 4x in time
    theirs = expected.audio[0].numpy()
    assert sample_rate == rate == decoder.audio.vocoder.config.output_sampling_rate
    assert waveform.dtype == np.float32
    assert waveform.shape == theirs.shape == (2, mel_frames * samples_per_mel_frame)
    # 100 mel frames a second: the sound lasts about as long as the video's 17 frames at 24 fps (0.71 s).
    duration = waveform.shape[1] / sample_rate
    assert math.isclose(duration, mel_frames / 100)
    difference = float(np.abs(waveform - theirs).max())
    print(
        f"{preset}: waveform {waveform.shape} at {sample_rate} Hz ({duration:.3f} s, video "
        f"{SPEC.num_frames / FRAME_RATE:.3f} s), max abs diff {difference:.2e}, decoded in {seconds_taken:.2f} s"
    )
    assert difference <= WAVEFORM_TOLERANCE and float(np.abs(theirs).max()) > 0.01


def test_session_one_latent_frame_at_a_time_equals_whole_decode(
    decoder: LTX2Decoder, latents: tuple[torch.Tensor, torch.Tensor]
) -> None:
    video_latents, _ = latents
    whole = decoder.decode_video(video_latents)
    count = video_latents.shape[2]
    session = decoder.session(num_latent_frames=count)
    outputs = [session.decode_next(video_latents[:, :, index : index + 1]) for index in range(count)]
    for before_last in outputs[:-1]:
        assert before_last.dtype == torch.uint8 and before_last.shape == (0, SPEC.height, SPEC.width, 3)
    assert torch.equal(outputs[-1], whole)
    assert session.frames_decoded == SPEC.num_frames
    with pytest.raises(ValueError, match="have all been decoded"):
        session.decode_next(video_latents[:, :, :1])
    with pytest.raises(ValueError, match="needs num_latent_frames"):
        decoder.session()


def test_timestep_conditioned_vae_decodes_at_the_pipelines_timestep(
    preset: str,
    model: Path,
    pipeline: LTX2Pipeline,
    latents: tuple[torch.Tensor, torch.Tensor],
    tmp_path: Path,
) -> None:
    """A VAE converted with timestep conditioning (none is published) decodes at decode_timestep 0.0, as the
    pipeline's default; the timestep matters (another one gives other frames)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        vae = AutoencoderKLLTX2Video.from_config({**pipeline.vae.config, "timestep_conditioning": True}).eval()
    # The statistics the denoiser de-normalises with stay the checkpoint's.
    vae.latents_mean.copy_(pipeline.vae.latents_mean)
    vae.latents_std.copy_(pipeline.vae.latents_std)
    conditioned = tmp_path / "conditioned"
    conditioned.mkdir()
    for part in model.iterdir():
        if part.name != "vae":
            (conditioned / part.name).symlink_to(part)
    vae.save_pretrained(conditioned / "vae")

    reference = LTX2Pipeline.from_pretrained(conditioned)
    reference.set_progress_bar_config(disable=True)
    assert reference.vae.config.timestep_conditioning
    expected = run_pipeline(reference, SPEC).output
    decoder = LTX2Decoder(conditioned, CPU, torch.float32)
    video_latents, _ = latents
    frames = decoder.decode_video(video_latents)
    compare_frames(f"{preset} timestep-conditioned", frames, expected.frames[0])
    with torch.no_grad():
        other = decoder.vae.decode(video_latents, torch.tensor([0.5]), return_dict=False)[0]
    assert (other.clamp(-1, 1) - decoder.decode_video_float(video_latents)).abs().max() > 1e-2


# The decoder layouts of diffusers' scripts/convert_ltx2_to_diffusers.py (get_ltx2_video_vae_config, versions "2.0"
# and "2.3"), which the published configs carry, at narrow widths: the widths do not change which frames depend on
# which latent frames.
PUBLISHED_DECODERS: dict[str, dict[str, Any]] = {
    "2.0": dict(
        decoder_block_out_channels=(8, 16, 32),
        decoder_layers_per_block=(5, 5, 5, 5),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual=(True, True, True),
        upsample_factor=(2, 2, 2),
        decoder_spatial_padding_mode="reflect",
    ),
    "2.3": dict(
        decoder_block_out_channels=(8, 16, 16, 32),
        decoder_layers_per_block=(4, 6, 4, 2, 2),
        decoder_spatio_temporal_scaling=(True, True, True, True),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
        upsample_residual=(False, False, False, False),
        upsample_factor=(2, 2, 1, 2),
        decoder_spatial_padding_mode="zeros",
    ),
}
# The last latent frame each layout's first output frame depends on, of LTX2Pipeline's default 16 (121 frames).
FIRST_FRAME_DEPENDS_ON = {"2.0": 15, "2.3": 14}


@pytest.mark.parametrize("layout", ["2.0", "2.3"])
def test_published_decoders_are_not_causal(layout: str) -> None:
    """Why the session decodes at the last latent frame: the first frame cannot leave before the 15th latent frame."""
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        patch_size=4,
        encoder_causal=True,
        decoder_causal=False,
        timestep_conditioning=False,
        spatial_compression_ratio=32,
        temporal_compression_ratio=8,
        **PUBLISHED_DECODERS[layout],
    ).eval()
    # float64: a latent frame at the edge of a frame's reach moves it by about 1e-11 (less than float32 resolves).
    vae = vae.double()
    latent_frames = (121 - 1) // 8 + 1
    latents = torch.randn(1, 8, latent_frames, 2, 2, dtype=torch.float64)

    def first_frame(z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            video = vae.decode(z, return_dict=False)[0]
        assert video.shape[2] == 121
        return video[:, :, 0]

    def changed_by(index: int) -> bool:
        moved = latents.clone()
        moved[:, :, index] += 1.0
        return not torch.equal(first_frame(moved), base)

    base = first_frame(latents)
    last = FIRST_FRAME_DEPENDS_ON[layout]
    assert changed_by(last)
    if last + 1 < latent_frames:
        assert not changed_by(last + 1)
