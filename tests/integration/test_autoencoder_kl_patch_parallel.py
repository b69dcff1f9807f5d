"""Patch-parallel decode of diffusers' 2D VAE decoder equals its whole decode: AutoencoderKL (FLUX.1's decoder,
which Z-Image serves too) and AutoencoderKLFlux2 (FLUX.2 klein's).

On gloo at 2 and 3 ranks, each rank decoding a band of latent rows (odd counts among them), the gathered image
equals what the family's decoder session decodes on one device within 1e-5 in float32, and the band GroupNorm
(whole-image statistics from all-reduced sums) equals torch's group_norm within 1e-5; the stage accepts
--vae-patch-parallel-size for the three families' checkpoints. Both world sizes run in one spawn of three
processes (the 2-rank decodes on a subgroup), to keep process start-ups few. The VAE stage's rank group
(vae_svc/group.py) decoding with FLUX.1's decoder is proven through the cluster:
tests/e2e/test_image_families_cluster.py serves FLUX.1 with --vae-patch-parallel-size 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from diffusers.models.attention_processor import AttnProcessor
from diffusers.models.autoencoders.vae import Decoder

from families.flux.decode import FluxDecoder
from families.flux2_klein.decode import Flux2KleinDecoder
from stagekit.decode import LatentDecoder
from stagekit.parallel.launch import run_ranks
from vae_svc.band_kl import KL_BAND_MODULES, band_group_norm
from vae_svc.patch_parallel import (
    PatchParallelDecodeSession,
    band_modules_for,
    disable_patch_parallel,
    enable_patch_parallel,
)
from vae_svc.row_bands import RowBands, band_rows

TOLERANCE = 1e-5
CPU = torch.device("cpu")
DECODERS: dict[str, type[LatentDecoder]] = {"flux": FluxDecoder, "flux2-klein": Flux2KleinDecoder}
# The tiny checkpoints' latent channels: FLUX.1's 16; FLUX.2 klein's 2x2 patches of its VAE's 8.
LATENT_CHANNELS = {"flux": 16, "flux2-klein": 32}

# (case name, family, latent height, latent width): odd and even latent row counts, uneven bands (7 rows: 4+3 on
# 2 ranks, 3+2+2 on 3) and, on 3 ranks, one latent row per rank. FLUX.2 klein's latents are 2x2 patches: each
# latent row is two rows of the VAE's latents.
CASES = {
    2: [("flux-7x5", "flux", 7, 5), ("flux-6x4", "flux", 6, 4), ("klein-5x3", "flux2-klein", 5, 3)],
    3: [("flux-3x5", "flux", 3, 5), ("flux-7x5", "flux", 7, 5), ("klein-7x4", "flux2-klein", 7, 4)],
}


@pytest.fixture(scope="module")
def model_dirs(flux_model: Path, klein_model: Path) -> dict[str, str]:
    return {"flux": str(flux_model), "flux2-klein": str(klein_model)}


def _latents(family: str, height: int, width: int, seed: int = 0) -> torch.Tensor:
    channels = LATENT_CHANNELS[family]
    return torch.randn(1, channels, 1, height, width, generator=torch.Generator().manual_seed(seed))


def _group_norm_inputs() -> tuple[torch.nn.GroupNorm, torch.Tensor]:
    """A GroupNorm with drawn affine parameters and an input whose groups have means far from zero."""
    generator = torch.Generator().manual_seed(5)
    norm = torch.nn.GroupNorm(4, 16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=generator))
        norm.bias.copy_(torch.randn(16, generator=generator))
    x = torch.randn(2, 16, 14, 9, generator=generator) * 3 + 20 * torch.randn(1, 16, 1, 1, generator=generator)
    return norm, x


def _decode_on_ranks(rank: int, world_size: int, cases: dict[int, list], uint8_case: tuple) -> dict:
    """On 2 ranks (a subgroup of ranks 0 and 1) and then on all 3: every case decoded on this rank's band, one
    to uint8 on group rank 0 only, and the band GroupNorm alone. Results are keyed by (ranks, name)."""
    pair = dist.new_group([0, 1])  # every rank of the default group joins the call
    decoders: dict[str, LatentDecoder] = {}
    results: dict = {}
    for size, group in ((2, pair), (3, None)):
        if rank >= size:
            continue
        for name, family, model_dir, latents in cases[size]:
            if family not in decoders:
                decoders[family] = DECODERS[family](model_dir, CPU, torch.float32)
            session = PatchParallelDecodeSession(decoders[family], group)
            results[size, name] = session.decode_next_float(latents)
            assert session.frames_decoded == 1

        family, latents = uint8_case
        uint8_session = PatchParallelDecodeSession(decoders[family], group, output_rank=0)
        results[size, "uint8 on rank 0"] = uint8_session.decode_next(latents)

        norm, x = _group_norm_inputs()
        bands = RowBands(group, rank, size, tuple(band_rows(x.shape[-2], size)))
        with torch.no_grad():
            band = x[..., bands.latent_start : bands.latent_stop, :]
            results[size, "group norm"] = band_group_norm(norm, band, bands)
    return results


def test_kl_patch_parallel_equals_whole_decode(model_dirs) -> None:
    """2 and 3 ranks, in one spawn of 3 processes (the 2-rank decodes run on a subgroup)."""
    inputs = {
        size: [
            (name, family, model_dirs[family], _latents(family, height, width)) for name, family, height, width in cases
        ]
        for size, cases in CASES.items()
    }
    uint8_case = ("flux", _latents("flux", 5, 6, seed=1))
    per_rank = run_ranks(_decode_on_ranks, 3, inputs, uint8_case)

    report: list[tuple[str, int, float]] = []
    norm, x = _group_norm_inputs()
    with torch.no_grad():
        expected_norm = norm(x)
    family, latents = uint8_case
    expected_frames = FluxDecoder(model_dirs[family], CPU, torch.float32).session().decode_next(latents)
    for size, cases in inputs.items():
        for name, family, model_dir, latents in cases:
            expected = DECODERS[family](model_dir, CPU, torch.float32).session().decode_next_float(latents)
            scale = 16 if family == "flux2-klein" else 8
            assert expected.shape == (1, 3, 1, latents.shape[-2] * scale, latents.shape[-1] * scale)
            for rank in range(size):
                actual = per_rank[rank][size, name]
                assert actual.shape == expected.shape, f"{name} rank {rank}: {actual.shape} != {expected.shape}"
                report.append((f"{size} ranks, {name}", rank, (actual - expected).abs().max().item()))
        gathered = torch.cat([per_rank[rank][size, "group norm"] for rank in range(size)], dim=-2)
        report.append((f"{size} ranks, group norm", -1, (gathered - expected_norm).abs().max().item()))

        frames = per_rank[0][size, "uint8 on rank 0"]
        assert frames.dtype == torch.uint8 and frames.shape == expected_frames.shape == (1, 40, 48, 3)
        levels = (frames.int() - expected_frames.int()).abs().max().item()
        assert levels <= 1, f"{size} ranks, uint8 frames: {levels} levels off"
        assert all(per_rank[rank][size, "uint8 on rank 0"] is None for rank in range(1, size)), "not rank 0"
    print("\n".join(f"{name} rank {rank}: max abs diff {diff:.2e}" for name, rank, diff in report))
    worst = max(report, key=lambda row: row[2])
    assert worst[2] <= TOLERANCE, f"{worst[0]} on rank {worst[1]}: max abs difference {worst[2]:.2e} > {TOLERANCE}"


def test_kl_band_forwards_cover_the_decoder_and_leave_plain_sessions_alone(model_dirs) -> None:
    """Every 3x3 conv, GroupNorm and the mid-block attention get band forwards; a plain session on the patched
    model, and a single-device patch-parallel session, decode as before; an attention processor the band
    forward does not reproduce is refused."""
    decoder = FluxDecoder(model_dirs["flux"], CPU, torch.float32)
    latents = _latents("flux", 5, 4, seed=2)
    expected = decoder.session().decode_next_float(latents)
    assert band_modules_for(decoder.vae.decoder) is KL_BAND_MODULES
    installed = enable_patch_parallel(decoder.vae.decoder)
    norms = [m for m in decoder.vae.decoder.modules() if isinstance(m, torch.nn.GroupNorm)]
    attention = decoder.vae.decoder.mid_block.attentions[0]
    covered = set(attention.modules())
    spatial = [
        m
        for m in decoder.vae.decoder.modules()
        if m not in covered and (isinstance(m, torch.nn.GroupNorm) or getattr(m, "kernel_size", (1,))[0] == 3)
    ]
    assert installed == len(spatial) + 1 and len(norms) > 1 and "forward" in attention.__dict__

    assert torch.equal(decoder.session().decode_next_float(latents), expected), "a plain session on the patched model"
    session = PatchParallelDecodeSession(decoder)
    assert torch.equal(session.decode_next_float(latents), expected), "single-device patch-parallel session"
    disable_patch_parallel(decoder.vae.decoder)
    assert not any("forward" in module.__dict__ for module in decoder.vae.decoder.modules())

    other = Decoder(in_channels=4, block_out_channels=(8,), norm_num_groups=4)
    other.mid_block.attentions[0].set_processor(AttnProcessor())
    with pytest.raises(NotImplementedError, match="AttnProcessor2_0 only"):
        enable_patch_parallel(other)


def test_kl_vae_decode_check_accepts_patch_parallel(flux_model: Path, z_image_model: Path, klein_model: Path) -> None:
    from services.stage_options import add_stage_arguments
    from vae_svc.config import VaeConfig
    from vae_svc.options import add_decode_arguments

    parser = argparse.ArgumentParser()
    add_stage_arguments(parser, default_port=0)
    add_decode_arguments(parser)
    for model in (flux_model, z_image_model, klein_model):
        config = VaeConfig.from_args(parser.parse_args(["--model", str(model), "--vae-patch-parallel-size", "2"]))
        assert config.decode.patch_parallel_size == 2
