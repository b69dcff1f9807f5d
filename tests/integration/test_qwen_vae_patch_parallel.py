"""Patch-parallel decode of the Qwen-Image VAE (AutoencoderKLQwenImage) equals its whole decode.

On gloo at 2 and 3 ranks, each rank decoding a band of latent rows, the gathered image equals what
`QwenImageDecoder(...).session()` decodes on one device (`AutoencoderKLQwenImage.decode`), before and after
the uint8 conversion; the rank group the VAE stage runs (vae_svc/group.py) builds the family's decoder;
the stage accepts --vae-patch-parallel-size for a qwen-image checkpoint, and through the cluster the image
equals QwenImagePipeline's within one level.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
from pathlib import Path

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageAttentionBlock, QwenImageCausalConv3d

from families.qwen_image.decode import QwenDecodeSession, QwenImageDecoder
from families.qwen_image.init_model import build_vae
from stagekit.parallel.launch import run_ranks
from vae_svc.band_wan import QWEN_IMAGE_BAND_MODULES
from vae_svc.patch_parallel import (
    PatchParallelDecodeSession,
    band_modules_for,
    band_rows,
    disable_patch_parallel,
    enable_patch_parallel,
)

TOLERANCE = 1e-4
CPU = torch.device("cpu")
LATENT_CHANNELS = 16


# (case name, vae, latent height, latent width). Heights give even and uneven bands (7 rows: 4+3 on 2 ranks,
# 3+2+2 on 3; 10 rows: 4+3+3; 8 rows: 3+3+2) and, on 3 ranks, the minimum of one latent row per rank.
CASES_2 = [
    ("tiny-6x5", "tiny", 6, 5),
    ("tiny-7x5", "tiny", 7, 5),
    ("tiny-9x4", "tiny", 9, 4),
    ("small-7x5", "small", 7, 5),
]


CASES_3 = [
    ("tiny-3x5", "tiny", 3, 5),
    ("tiny-6x5", "tiny", 6, 5),
    ("tiny-7x5", "tiny", 7, 5),
    ("tiny-8x6", "tiny", 8, 6),
    ("tiny-10x4", "tiny", 10, 4),
    ("small-8x5", "small", 8, 5),
]


@pytest.fixture(scope="module")
def vae_dirs(qwen_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Checkpoint roots with a vae/ folder: the tiny qwen-image checkpoint, and the small preset's VAE."""
    small = tmp_path_factory.mktemp("qwen-vaes") / "small"
    build_vae("small", seed=0).save_pretrained(small / "vae")
    return {"tiny": str(qwen_model), "small": str(small)}


def _latents(height: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, LATENT_CHANNELS, 1, height, width, generator=generator)


def _reference(model_dir: str, latents: torch.Tensor) -> torch.Tensor:
    """The single-device decode the stage serves: `AutoencoderKLQwenImage.decode` of the denormalised latents."""
    return QwenImageDecoder(model_dir, CPU, torch.float32).session().decode_next_float(latents)


def _decode_on_ranks(rank: int, world_size: int, cases: list, uint8_case: tuple, too_short: tuple) -> dict:
    """Every case decoded on this rank's band; one also to uint8 on group rank 0 only; and a too-short latent."""
    decoders: dict[str, QwenImageDecoder] = {}
    results: dict = {}
    for name, model_dir, latents in cases:
        if model_dir not in decoders:
            decoders[model_dir] = QwenImageDecoder(model_dir, CPU, torch.float32)
        session = PatchParallelDecodeSession(decoders[model_dir])
        results[name] = session.decode_next_float(latents)
        assert session.frames_decoded == 1

    model_dir, latents = uint8_case
    results["uint8 on rank 0"] = PatchParallelDecodeSession(decoders[model_dir], output_rank=0).decode_next(latents)

    model_dir, latents = too_short
    try:
        PatchParallelDecodeSession(decoders[model_dir]).decode_next(latents)
        results["too_short"] = "no error"
    except ValueError as error:
        results["too_short"] = str(error)
    return results


@pytest.mark.parametrize(("world_size", "cases"), [(2, CASES_2), (3, CASES_3)], ids=["2-ranks", "3-ranks"])
def test_qwen_patch_parallel_equals_whole_decode(vae_dirs, world_size, cases) -> None:
    inputs = [(name, vae_dirs[vae], _latents(height, width)) for name, vae, height, width in cases]
    uint8_case = (vae_dirs["tiny"], _latents(7, 6, seed=1))
    too_short = (vae_dirs["tiny"], _latents(world_size - 1, 5))
    per_rank = run_ranks(_decode_on_ranks, world_size, inputs, uint8_case, too_short)

    report = []
    for name, model_dir, latents in inputs:
        expected = _reference(model_dir, latents)
        assert expected.shape == (1, 3, 1, latents.shape[-2] * 8, latents.shape[-1] * 8)
        for rank in range(world_size):
            actual = per_rank[rank][name]
            assert actual.shape == expected.shape, f"{name} rank {rank}: shape {actual.shape} != {expected.shape}"
            report.append((name, rank, (actual - expected).abs().max().item()))
    print("\n".join(f"{name} rank {rank}: max abs diff {diff:.2e}" for name, rank, diff in report))
    worst = max(report, key=lambda row: row[2])
    assert worst[2] <= TOLERANCE, f"{worst[0]} on rank {worst[1]}: max abs difference {worst[2]:.2e} > {TOLERANCE}"

    model_dir, latents = uint8_case
    frames = per_rank[0]["uint8 on rank 0"]
    expected_frames = QwenImageDecoder(model_dir, CPU, torch.float32).session().decode_next(latents)
    assert frames.dtype == torch.uint8 and frames.shape == expected_frames.shape == (1, 56, 48, 3)
    levels = (frames.int() - expected_frames.int()).abs().max().item()
    print(f"uint8 frames on rank 0: {levels} levels off")
    assert levels <= 1, f"uint8 frames: {levels} levels off"
    assert all(results["uint8 on rank 0"] is None for results in per_rank[1:]), "ranks other than 0 got frames"

    for rank, results in enumerate(per_rank):
        message = results["too_short"]
        assert f"latent height {world_size - 1}" in message and "at least 1 latent row" in message, (rank, message)


def test_qwen_band_forwards_cover_its_decoder_and_leave_plain_sessions_alone(vae_dirs) -> None:
    """The Qwen decoder's spatial convs and mid-block attention get band forwards; a plain session on the
    patched model, and a single-device patch-parallel session, decode as before."""
    latents = _latents(6, 5, seed=2)
    expected = _reference(vae_dirs["tiny"], latents)
    decoder = QwenImageDecoder(vae_dirs["tiny"], CPU, torch.float32)
    assert band_modules_for(decoder.vae.decoder) is QWEN_IMAGE_BAND_MODULES
    installed = enable_patch_parallel(decoder.vae.decoder)
    spatial = [
        m
        for m in decoder.vae.decoder.modules()
        if (isinstance(m, QwenImageCausalConv3d) and m.kernel_size[1] > 1)
        or (isinstance(m, torch.nn.Conv2d) and m.kernel_size[0] > 1)
        or isinstance(m, QwenImageAttentionBlock)
    ]
    assert installed == len(spatial) > 0 and any(isinstance(m, QwenImageAttentionBlock) for m in spatial)

    plain = QwenDecodeSession(decoder).decode_next_float(latents)
    assert torch.equal(plain, expected), "a plain session on the patched model decodes differently"
    session = PatchParallelDecodeSession(decoder)
    assert torch.equal(session.decode_next_float(latents), expected), "single-device patch-parallel session"
    disable_patch_parallel(decoder.vae.decoder)
    assert not any("forward" in module.__dict__ for module in decoder.vae.decoder.modules())

    with pytest.raises(NotImplementedError, match="does not know the decoder Sequential"):
        enable_patch_parallel(torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1)))


def _group_decode(model_dir: str, latents: list[torch.Tensor], results) -> None:
    """In its own process (rank 0 joins the group there): the VAE stage's rank group decodes each latent."""
    from services.checkpoint import read_checkpoint
    from vae_svc.group import PatchParallelDecoder

    decoder_class = read_checkpoint(model_dir).traits.load("decoder")
    decoder = PatchParallelDecoder(model_dir, CPU, torch.float32, threads=1, size=2, decoder_class=decoder_class)
    try:
        frames = []
        for latent in latents:
            session = decoder.session()
            frames.append(session.decode_next(latent))
            assert session.frames_decoded == 1
            session.close()
        buffer = io.BytesIO()
        torch.save({"decoder": type(decoder.worker.decoder).__name__, "frames": frames}, buffer)
        results.put(buffer.getvalue())
    finally:
        decoder.close()


def test_vae_rank_group_decodes_with_the_qwen_decoder(qwen_model: Path) -> None:
    """vae_svc/group.py builds the checkpoint family's decoder on every rank; start/frame/end per request."""
    latents = [_latents(8, 6, seed=3), _latents(7, 4, seed=4)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_group_decode, args=(str(qwen_model), latents, results))
    process.start()
    try:
        outcome = torch.load(io.BytesIO(results.get(timeout=300)))
    finally:
        process.join(timeout=60)
    assert process.exitcode == 0
    assert outcome["decoder"] == "QwenImageDecoder"
    single = QwenImageDecoder(qwen_model, CPU, torch.float32)
    for latent, frames in zip(latents, outcome["frames"], strict=True):
        expected = single.session().decode_next(latent)
        assert frames.shape == expected.shape
        levels = (frames.int() - expected.int()).abs().max().item()
        assert levels <= 1, f"{tuple(latent.shape)}: {levels} levels off"


def test_qwen_vae_decode_check_accepts_patch_parallel(qwen_model: Path) -> None:
    from services.stage_options import add_stage_arguments
    from vae_svc.config import VaeConfig
    from vae_svc.options import add_decode_arguments

    parser = argparse.ArgumentParser()
    add_stage_arguments(parser, default_port=0)
    add_decode_arguments(parser)
    for size in ("2", "3"):
        VaeConfig.from_args(parser.parse_args(["--model", str(qwen_model), "--vae-patch-parallel-size", size]))
    with pytest.raises(SystemExit, match="--vae-use-tiling and --vae-patch-parallel-size > 1 are exclusive"):
        VaeConfig.from_args(
            parser.parse_args(["--model", str(qwen_model), "--vae-patch-parallel-size", "2", "--vae-use-tiling"])
        )


def test_band_rows_of_qwen_heights() -> None:
    """Qwen-Image heights are multiples of 16: latent rows are even, so 2 ranks split evenly and 3 may not."""
    assert band_rows(8, 2) == [4, 4]
    assert band_rows(8, 3) == [3, 3, 2]
    assert band_rows(10, 3) == [4, 3, 3]
