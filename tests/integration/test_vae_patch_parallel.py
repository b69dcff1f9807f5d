"""Patch-parallel VAE decode equals the untiled decode (gloo, 2 and 4 ranks); tiled decode equals diffusers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from families.wan.components import build_vae
from families.wan.decode import WanDecodeSession, WanStreamingDecoder
from stagekit.parallel.launch import run_ranks
from vae_svc.patch_parallel import (
    PatchParallelDecodeSession,
    band_rows,
    disable_patch_parallel,
    enable_patch_parallel,
)
from vae_svc.tiled import TiledDecodeSession

TOLERANCE = 1e-4
TILED_TOLERANCE = 1e-5
LATENT_FRAMES = 3  # the first frame, then two through the causal cache (9 video frames)
CPU = torch.device("cpu")

# A Wan2.2-style VAE (residual up blocks with DupUp3D shortcuts, 2x2 patchified output), scaled down.
WAN22_CONFIG = dict(
    base_dim=8,
    decoder_base_dim=12,
    z_dim=16,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    temperal_downsample=[False, True, True],
)

# (case name, vae name, latent height, latent width). Heights give even and uneven bands; on 4 ranks
# height 4 is the minimum of one latent row per rank.
CASES_2 = [
    ("tiny-6x5", "tiny", 6, 5),
    ("tiny-7x5", "tiny", 7, 5),
    ("tiny-9x4", "tiny", 9, 4),
    ("small-7x5", "small", 7, 5),
    ("wan22-5x4", "wan22", 5, 4),
]
CASES_4 = [
    ("tiny-4x5", "tiny", 4, 5),
    ("tiny-6x5", "tiny", 6, 5),
    ("tiny-7x5", "tiny", 7, 5),
    ("tiny-9x4", "tiny", 9, 4),
]


@pytest.fixture(scope="module")
def vae_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Checkpoint roots (each with a vae/ folder) for the tiny and small presets and a Wan2.2-style VAE."""
    root = tmp_path_factory.mktemp("vaes")
    dirs = {}
    for name in ("tiny", "small", "wan22"):
        torch.manual_seed(0)
        vae = AutoencoderKLWan(**WAN22_CONFIG).eval() if name == "wan22" else build_vae(name, seed=0)
        vae.save_pretrained(root / name / "vae")
        dirs[name] = str(root / name)
    return dirs


def _latents(height: int, width: int, seed: int = 0) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, LATENT_FRAMES, height, width, generator=generator).numpy()


def _reference(model_dir: str, latents: np.ndarray, **tiling: int) -> torch.Tensor:
    """The library's whole-video decode of normalised latents, denormalised as the pipeline does."""
    decoder = WanStreamingDecoder(model_dir, CPU, torch.float32)
    if tiling:
        decoder.vae.enable_tiling(**tiling)
    z = torch.from_numpy(latents) / decoder.latents_std + decoder.latents_mean
    with torch.no_grad():
        return decoder.vae.decode(z).sample


def _stream(session, latents: np.ndarray) -> torch.Tensor | None:
    video = torch.from_numpy(latents)
    frames = [session.decode_next_float(video[:, :, k : k + 1]) for k in range(video.shape[2])]
    return None if frames[0] is None else torch.cat(frames, dim=2)


def _decode_on_ranks(rank: int, world_size: int, cases: list, output_rank_case: tuple, too_short: tuple) -> dict:
    """Runs every case on this rank's band; also a rank-0-only gather and a too-short latent."""
    decoders: dict[str, WanStreamingDecoder] = {}
    results: dict = {}
    for name, model_dir, latents in cases:
        if model_dir not in decoders:
            decoders[model_dir] = WanStreamingDecoder(model_dir, CPU, torch.float32)
        results[name] = _stream(PatchParallelDecodeSession(decoders[model_dir]), latents).numpy()

    model_dir, latents = output_rank_case
    frames = _stream(PatchParallelDecodeSession(decoders[model_dir], output_rank=0), latents)
    results["output_rank=0"] = None if frames is None else frames.numpy()

    model_dir, latents = too_short
    try:
        PatchParallelDecodeSession(decoders[model_dir]).decode_next(torch.from_numpy(latents)[:, :, :1])
        results["too_short"] = "no error"
    except ValueError as error:
        results["too_short"] = str(error)
    return results


@pytest.mark.parametrize(("world_size", "cases"), [(2, CASES_2), (4, CASES_4)], ids=["2-ranks", "4-ranks"])
def test_patch_parallel_equals_untiled_decode(vae_dirs, world_size, cases) -> None:
    inputs = [(name, vae_dirs[vae], _latents(height, width)) for name, vae, height, width in cases]
    output_rank_case = (vae_dirs["tiny"], _latents(7, 5, seed=1))
    too_short = (vae_dirs["tiny"], _latents(world_size - 1, 5))
    per_rank = run_ranks(_decode_on_ranks, world_size, inputs, output_rank_case, too_short)

    report = []
    for name, model_dir, latents in [*inputs, ("output_rank=0", *output_rank_case)]:
        expected = _reference(model_dir, latents)
        ranks = [0] if name == "output_rank=0" else range(world_size)
        for rank in ranks:
            actual = torch.from_numpy(per_rank[rank][name])
            assert actual.shape == expected.shape, f"{name} rank {rank}: shape {actual.shape} != {expected.shape}"
            report.append((name, rank, (actual - expected).abs().max().item()))
    print("\n".join(f"{name} rank {rank}: max abs diff {diff:.2e}" for name, rank, diff in report))
    worst = max(report, key=lambda row: row[2])
    assert worst[2] <= TOLERANCE, f"{worst[0]} on rank {worst[1]}: max abs difference {worst[2]:.2e} > {TOLERANCE}"

    assert all(results["output_rank=0"] is None for results in per_rank[1:]), "ranks other than 0 got frames"
    for rank, results in enumerate(per_rank):
        message = results["too_short"]
        assert f"latent height {world_size - 1}" in message and "at least 1 latent row" in message, (rank, message)


def test_band_rows_split_and_limits() -> None:
    assert band_rows(7, 3) == [3, 2, 2]
    assert band_rows(9, 4) == [3, 2, 2, 2]
    assert band_rows(4, 4) == [1, 1, 1, 1]
    assert band_rows(5, 1) == [5]
    with pytest.raises(ValueError, match="world size must be at least 1"):
        band_rows(6, 0)
    with pytest.raises(ValueError, match="latent height 3 is smaller than the patch-parallel world size 4"):
        band_rows(3, 4)


def test_single_device_session_and_shared_model(vae_dirs) -> None:
    """Without a process group the session is the plain decode, and installing the band forwards
    leaves other sessions on the same model unchanged."""
    latents = _latents(6, 5, seed=2)
    expected = _reference(vae_dirs["tiny"], latents)
    decoder = WanStreamingDecoder(vae_dirs["tiny"], CPU, torch.float32)
    session = PatchParallelDecodeSession(decoder)
    difference = (_stream(session, latents) - expected).abs().max().item()
    assert difference <= TOLERANCE, f"single-device patch-parallel session: max abs difference {difference:.2e}"
    assert session.frames_decoded == expected.shape[2]

    assert enable_patch_parallel(decoder.vae.decoder) > 0  # already installed: idempotent
    plain = WanDecodeSession(decoder)
    video = torch.from_numpy(latents)
    frames = torch.cat([plain.decode_next(video[:, :, k : k + 1]) for k in range(LATENT_FRAMES)])
    expected_uint8 = ((expected[0].permute(1, 2, 3, 0) / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    levels = (frames.int() - expected_uint8.int()).abs().max().item()
    assert levels <= 1, f"plain session on a patched model: {levels} uint8 levels off"
    disable_patch_parallel(decoder.vae.decoder)
    assert not any("forward" in module.__dict__ for module in decoder.vae.decoder.modules())


@pytest.mark.parametrize(
    ("vae", "height", "width", "tiles"),
    [("tiny", 9, 7, (32, 32, 24, 24)), ("tiny", 6, 9, (40, 24, 24, 16)), ("wan22", 5, 4, (32, 32, 16, 16))],
    ids=["tiny-3x3-tiles", "tiny-uneven-tiles", "wan22"],
)
def test_tiled_session_equals_diffusers_tiled_decode(vae_dirs, vae, height, width, tiles) -> None:
    """Streaming tiled decode is diffusers' tiled decode; both are only an approximation of the untiled one."""
    min_height, min_width, stride_height, stride_width = tiles
    latents = _latents(height, width, seed=3)
    decoder = WanStreamingDecoder(vae_dirs[vae], CPU, torch.float32)
    session = TiledDecodeSession(decoder, min_height, min_width, stride_height, stride_width)
    actual = _stream(session, latents)
    assert len(session.tile_caches) > 1, "the case must use several tiles"
    tiled = _reference(
        vae_dirs[vae],
        latents,
        tile_sample_min_height=min_height,
        tile_sample_min_width=min_width,
        tile_sample_stride_height=stride_height,
        tile_sample_stride_width=stride_width,
    )
    difference = (actual - tiled).abs().max().item()
    assert actual.shape == tiled.shape
    assert difference <= TILED_TOLERANCE, f"tiled session vs vae.tiled_decode: max abs difference {difference:.2e}"
    seams = (actual - _reference(vae_dirs[vae], latents)).abs().max().item()
    print(f"{vae} {height}x{width} tiles {tiles}: vs tiled_decode {difference:.2e}, vs untiled {seams:.2e}")
    assert seams > 1e-3, f"tiled decode unexpectedly equals the untiled decode (max abs difference {seams:.2e})"


def test_tiled_session_rejects_strides_below_compression(vae_dirs) -> None:
    decoder = WanStreamingDecoder(vae_dirs["tiny"], CPU, torch.float32)
    with pytest.raises(ValueError, match="tile_sample_stride_height must be at least"):
        TiledDecodeSession(decoder, 32, 32, 4, 16)
    with pytest.raises(ValueError, match="must not exceed the tile sizes"):
        TiledDecodeSession(decoder, 32, 32, 40, 16)


def test_single_tile_tiled_session_equals_untiled(vae_dirs) -> None:
    """One tile covering the frame decodes like the untiled decode (the tiled path is then a no-op)."""
    latents = _latents(4, 4, seed=4)
    decoder = WanStreamingDecoder(vae_dirs["tiny"], CPU, torch.float32)
    actual = _stream(TiledDecodeSession(decoder, 32, 32, 32, 32), latents)
    difference = (actual - _reference(vae_dirs["tiny"], latents)).abs().max().item()
    assert difference <= TILED_TOLERANCE, f"single tile vs untiled: max abs difference {difference:.2e}"
