"""Streaming HunyuanVideo 1.5 VAE decode (families/hunyuanvideo_15/decode.py) and its patch-parallel band forwards
(vae_svc/band_hunyuanvideo15.py), on a tiny random AutoencoderKLHunyuanVideo15.

Streamed latent frame by latent frame, the frames equal HunyuanVideo15Pipeline's decode of the whole latent video
(`vae.decode(latents / scaling_factor)` then its video processor) within float rounding and one uint8 level; latent
frame 0 gives 1 frame and each later one 4; sessions sharing a decoder, interleaved or in threads, keep their own
caches; `vae.decode` on the streamed model stays the library's. On 2 gloo ranks, each decoding a band of rows, the
gathered frames equal the single-device stream, and the band forwards hand the modules back to the stream forwards.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo15
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import (
    HunyuanVideo15AttnBlock,
    HunyuanVideo15CausalConv3d,
    HunyuanVideo15Upsample,
)
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

from families.hunyuanvideo_15.decode import (
    HunyuanVideo15DecodeSession,
    HunyuanVideo15StreamingDecoder,
    install_stream_forwards,
    stream_attention_forward,
    stream_conv_forward,
    stream_upsample_forward,
)
from stagekit.parallel.launch import run_ranks
from vae_svc.band_hunyuanvideo15 import HUNYUANVIDEO15_BAND_MODULES, attention_forward, causal_conv_forward
from vae_svc.patch_parallel import (
    PatchParallelDecodeSession,
    band_modules_for,
    disable_patch_parallel,
    enable_patch_parallel,
)

CPU = torch.device("cpu")
FLOAT_TOLERANCE = 1e-5
LATENT_CHANNELS = 8
# Five blocks: spatial upsampling in the first four (x16), temporal in the first two (x4), as the released VAE.
TINY_CONFIG = dict(
    latent_channels=LATENT_CHANNELS,
    block_out_channels=(16, 16, 32, 32, 32),
    layers_per_block=1,
    spatial_compression_ratio=16,
    temporal_compression_ratio=4,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """The tiny model decodes fastest on one thread (and stays fast on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint root whose vae/ holds the tiny VAE, its weights drawn from seed 0."""
    root = tmp_path_factory.mktemp("hunyuanvideo15")
    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo15(**TINY_CONFIG).eval().save_pretrained(root / "vae")
    return root


def _latents(frames: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, LATENT_CHANNELS, frames, height, width, generator=generator)


def _fresh_vae(model_dir: Path) -> AutoencoderKLHunyuanVideo15:
    return AutoencoderKLHunyuanVideo15.from_pretrained(model_dir / "vae").eval()


def _pipeline_decode(vae: AutoencoderKLHunyuanVideo15, latents: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """HunyuanVideo15Pipeline's decode of the whole latent video: the decoder output clamped to [-1, 1] (what its
    video processor keeps) [1, 3, n, H, W], and the frames as the processor returns them, to uint8 [n, H, W, 3]."""
    with torch.no_grad():
        video = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=vae.spatial_compression_ratio)
    frames = processor.postprocess_video(video, output_type="np")[0]
    return video.clamp(-1, 1), (frames * 255).round().astype(np.uint8)


def _stream_float(session: HunyuanVideo15DecodeSession | PatchParallelDecodeSession, latents: torch.Tensor):
    """Decodes latent frame by latent frame: the concatenated output and each call's number of frames."""
    outputs = [session.decode_next_float(latents[:, :, k : k + 1]) for k in range(latents.shape[2])]
    return torch.cat(outputs, dim=2), [out.shape[2] for out in outputs]


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return (a - b).abs().max().item()


# --- single device ----------------------------------------------------------------------------------


def test_streamed_frames_equal_the_pipelines_whole_decode(model_dir: Path) -> None:
    latents = _latents(5, 3, 5)
    expected_float, expected_frames = _pipeline_decode(_fresh_vae(model_dir), latents)
    assert expected_float.shape == (1, 3, 17, 48, 80)
    # The comparison means something only where the decoder output is not clamped away.
    assert (expected_float.abs() < 1).float().mean() > 0.9

    decoder = HunyuanVideo15StreamingDecoder(model_dir, CPU, torch.float32)
    session = decoder.session()
    streamed, counts = _stream_float(session, latents)
    assert counts == [1, 4, 4, 4, 4]
    assert session.frames_decoded == 17
    difference = _max_difference(streamed, expected_float)
    print(f"streamed vs whole decode: max abs difference {difference:.2e}")
    assert difference <= FLOAT_TOLERANCE

    session = decoder.session()
    frames = [session.decode_next(latents[:, :, k : k + 1]) for k in range(latents.shape[2])]
    assert [f.shape for f in frames] == [(1, 48, 80, 3)] + [(4, 48, 80, 3)] * 4
    assert all(f.dtype == torch.uint8 for f in frames)
    levels = (torch.cat(frames).int() - torch.from_numpy(expected_frames).int()).abs().max().item()
    print(f"uint8 frames: {levels} levels off")
    assert levels <= 1

    # The cache matters: a later latent frame decoded on its own (as a first frame) gives other frames.
    alone = decoder.session().decode_next_float(latents[:, :, 1:2])
    assert _max_difference(alone[:, :, :1], streamed[:, :, 1:2]) > 1e-2


def test_several_latent_frames_per_call_equal_the_whole_decode(model_dir: Path) -> None:
    """Calls of several frames (the first call too) use the attention's causal mask between them."""
    latents = _latents(5, 3, 5, seed=1)
    expected, _ = _pipeline_decode(_fresh_vae(model_dir), latents)
    session = HunyuanVideo15StreamingDecoder(model_dir, CPU, torch.float32).session()
    first = session.decode_next_float(latents[:, :, :2])
    rest = session.decode_next_float(latents[:, :, 2:])
    assert (first.shape[2], rest.shape[2]) == (5, 12)
    difference = _max_difference(torch.cat([first, rest], dim=2), expected)
    print(f"chunks of 2 and 3 latent frames: max abs difference {difference:.2e}")
    assert difference <= FLOAT_TOLERANCE


def test_interleaved_sessions_keep_their_own_caches(model_dir: Path) -> None:
    videos = [_latents(4, 3, 5, seed=2), _latents(4, 3, 5, seed=3)]
    vae = _fresh_vae(model_dir)
    expected = [_pipeline_decode(vae, latents)[0] for latents in videos]
    decoder = HunyuanVideo15StreamingDecoder(model_dir, CPU, torch.float32)
    sessions = [decoder.session(), decoder.session()]
    outputs: list[list[torch.Tensor]] = [[], []]
    for k in range(4):
        for session, latents, out in zip(sessions, videos, outputs, strict=True):
            out.append(session.decode_next_float(latents[:, :, k : k + 1]))
    for index, (out, reference) in enumerate(zip(outputs, expected, strict=True)):
        difference = _max_difference(torch.cat(out, dim=2), reference)
        print(f"interleaved session {index}: max abs difference {difference:.2e}")
        assert difference <= FLOAT_TOLERANCE


def test_sessions_in_threads_keep_their_own_caches(model_dir: Path) -> None:
    """Two threads stream on one decoder in lockstep, each latent frame of one decoded beside the other's."""
    videos = [_latents(3, 3, 5, seed=4), _latents(3, 3, 5, seed=5)]
    vae = _fresh_vae(model_dir)
    expected = [_pipeline_decode(vae, latents)[0] for latents in videos]
    decoder = HunyuanVideo15StreamingDecoder(model_dir, CPU, torch.float32)
    lockstep = threading.Barrier(2)
    results: dict[int, torch.Tensor | BaseException] = {}

    def stream(index: int) -> None:
        try:
            session = decoder.session()
            out = []
            for k in range(3):
                lockstep.wait(timeout=60)
                out.append(session.decode_next_float(videos[index][:, :, k : k + 1]))
            results[index] = torch.cat(out, dim=2)
        except BaseException as error:  # reported by the test thread
            lockstep.abort()
            results[index] = error

    threads = [threading.Thread(target=stream, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for index in range(2):
        result = results[index]
        assert isinstance(result, torch.Tensor), f"thread {index}: {result!r}"
        difference = _max_difference(result, expected[index])
        print(f"thread {index}: max abs difference {difference:.2e}")
        assert difference <= FLOAT_TOLERANCE


def test_vae_decode_is_untouched_by_the_stream_forwards(model_dir: Path) -> None:
    decoder = HunyuanVideo15StreamingDecoder(model_dir, CPU, torch.float32)
    streamed_modules = [
        module
        for module in decoder.vae.decoder.modules()
        if isinstance(module, HunyuanVideo15CausalConv3d | HunyuanVideo15AttnBlock | HunyuanVideo15Upsample)
    ]
    assert all("forward" in module.__dict__ for module in streamed_modules)
    assert install_stream_forwards(decoder.vae.decoder) == len(streamed_modules)  # idempotent

    latents = _latents(3, 3, 5, seed=6)
    _stream_float(decoder.session(), latents)
    with torch.no_grad():
        actual = decoder.vae.decode(latents).sample
        expected = _fresh_vae(model_dir).decode(latents).sample
    assert torch.equal(actual, expected), "vae.decode of the streamed model differs from a fresh model's"

    conv = next(m for m in decoder.vae.decoder.modules() if isinstance(m, HunyuanVideo15CausalConv3d))
    conv.forward = lambda x: x
    with pytest.raises(RuntimeError, match="already has a replaced forward"):
        install_stream_forwards(decoder.vae.decoder)


# --- patch-parallel ---------------------------------------------------------------------------------

# Latent (frames, height, width) of two requests decoded side by side: bands of 3 + 2 latent rows, and of 2 + 1
# (a band one latent row tall).
PATCH_PARALLEL_SHAPES = [(3, 5, 3), (3, 3, 5)]


def _decode_on_ranks(rank: int, world_size: int, model_dir: str, videos: list, uint8_video: torch.Tensor) -> dict:
    """This rank's streams: two sessions interleaved frame by frame (full frames gathered on every rank), then one
    whose uint8 frames are gathered on rank 0 only."""
    decoder = HunyuanVideo15StreamingDecoder(model_dir, CPU, torch.float32)
    sessions = [PatchParallelDecodeSession(decoder) for _ in videos]
    outputs: list[list[torch.Tensor]] = [[] for _ in videos]
    for k in range(videos[0].shape[2]):
        for session, latents, out in zip(sessions, videos, outputs, strict=True):
            out.append(session.decode_next_float(latents[:, :, k : k + 1]))
    results: dict = {
        "videos": [torch.cat(out, dim=2) for out in outputs],
        "counts": [[o.shape[2] for o in out] for out in outputs],
        "frames_decoded": [session.frames_decoded for session in sessions],
    }
    session = PatchParallelDecodeSession(decoder, output_rank=0)
    frames = [session.decode_next(uint8_video[:, :, k : k + 1]) for k in range(uint8_video.shape[2])]
    results["uint8"] = None if frames[0] is None else torch.cat(frames)
    return results


def test_patch_parallel_streamed_decode_equals_single_device(model_dir: Path) -> None:
    videos = [_latents(*shape, seed=7 + index) for index, shape in enumerate(PATCH_PARALLEL_SHAPES)]
    uint8_video = _latents(3, 5, 3, seed=10)
    per_rank = run_ranks(_decode_on_ranks, 2, str(model_dir), videos, uint8_video)

    single = HunyuanVideo15StreamingDecoder(model_dir, CPU, torch.float32)
    report = []
    for index, latents in enumerate(videos):
        expected, expected_counts = _stream_float(single.session(), latents)
        assert expected_counts == [1, 4, 4]
        for rank, results in enumerate(per_rank):
            assert results["counts"][index] == expected_counts, f"video {index} rank {rank}: {results['counts']}"
            assert results["frames_decoded"][index] == 9
            report.append((f"video {index} rank {rank}", _max_difference(results["videos"][index], expected)))
    print("\n".join(f"{name}: max abs difference {difference:.2e}" for name, difference in report))
    worst = max(report, key=lambda row: row[1])
    assert worst[1] <= FLOAT_TOLERANCE, f"{worst[0]}: max abs difference {worst[1]:.2e}"

    session = single.session()
    expected_frames = torch.cat([session.decode_next(uint8_video[:, :, k : k + 1]) for k in range(3)])
    frames = per_rank[0]["uint8"]
    assert frames.dtype == torch.uint8 and frames.shape == expected_frames.shape == (9, 80, 48, 3)
    levels = (frames.int() - expected_frames.int()).abs().max().item()
    print(f"uint8 frames on rank 0: {levels} levels off")
    assert levels <= 1
    assert per_rank[1]["uint8"] is None, "rank 1 got frames"


def test_band_forwards_replace_the_stream_forwards_and_give_them_back(model_dir: Path) -> None:
    """The band forwards take the causal convs and attention from the stream forwards; without bands they
    stream as before, and disabling them puts the stream forwards back."""
    latents = _latents(3, 5, 3, seed=11)
    decoder = HunyuanVideo15StreamingDecoder(model_dir, CPU, torch.float32)
    expected, _ = _stream_float(decoder.session(), latents)
    assert band_modules_for(decoder.vae.decoder) is HUNYUANVIDEO15_BAND_MODULES

    def forward_of(module: torch.nn.Module):
        return module.__dict__["forward"].__func__

    convs = [m for m in decoder.vae.decoder.modules() if isinstance(m, HunyuanVideo15CausalConv3d)]
    attentions = [m for m in decoder.vae.decoder.modules() if isinstance(m, HunyuanVideo15AttnBlock)]
    upsamplers = [m for m in decoder.vae.decoder.modules() if isinstance(m, HunyuanVideo15Upsample)]
    assert enable_patch_parallel(decoder.vae.decoder) == len(convs) + len(attentions)
    assert all(forward_of(m) is causal_conv_forward for m in convs)
    assert all(forward_of(m) is attention_forward for m in attentions)
    assert all(forward_of(m) is stream_upsample_forward for m in upsamplers)
    assert enable_patch_parallel(decoder.vae.decoder) == len(convs) + len(attentions)  # idempotent

    plain, _ = _stream_float(decoder.session(), latents)
    assert torch.equal(plain, expected), "a plain session under band forwards"
    single_device, _ = _stream_float(PatchParallelDecodeSession(decoder), latents)
    assert torch.equal(single_device, expected), "a single-device patch-parallel session"

    disable_patch_parallel(decoder.vae.decoder)
    assert all(forward_of(m) is stream_conv_forward for m in convs)
    assert all(forward_of(m) is stream_attention_forward for m in attentions)
    after, _ = _stream_float(decoder.session(), latents)
    assert torch.equal(after, expected), "the stream after patch-parallel was disabled"

    convs[0].forward = lambda x: x
    with pytest.raises(RuntimeError, match="already has a replaced forward"):
        enable_patch_parallel(decoder.vae.decoder)
