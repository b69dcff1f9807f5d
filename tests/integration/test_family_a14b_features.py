"""Wan2.2 A14B (two experts switched at boundary_ratio): the patch-parallel VAE and interpolation on the
A14B checkpoint (the parallel layouts, offload, quantization and loading are tests/integration/
test_family_features.py's, from its tester config).

Both decode the latents of WanA14BTesterConfig's request (two UniPC steps, one per expert) on one rank: the
reference run tests/helpers/feature_mixins/ shares with the feature tests. The patch-parallel decode runs on
two gloo ranks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from families.wan.decode import WanStreamingDecoder
from interp_svc.interpolate import StreamingInterpolator, interpolate_sequence, output_frame_count
from interp_svc.rife import RifeInterpolator, StreamingRifeInterpolator, load_rife
from stagekit.parallel.launch import run_ranks
from tests.helpers.feature_mixins import WanA14BTesterConfig, reference_run
from tests.helpers.rife_weights import random_state_dict
from vae_svc.patch_parallel import PatchParallelDecodeSession

CPU = torch.device("cpu")
TOLERANCE = 1e-4
CONFIG = WanA14BTesterConfig()
SPEC = CONFIG.spec


def _vae_ranks(rank: int, world_size: int, model_dir: str, latents: torch.Tensor) -> torch.Tensor:
    """The patch-parallel decode of `latents`, frame by frame as the VAE stage streams them."""
    session = PatchParallelDecodeSession(WanStreamingDecoder(model_dir, CPU, torch.float32))
    frames = [session.decode_next_float(latents[:, :, t : t + 1]) for t in range(latents.shape[2])]
    return torch.cat(frames, dim=2)


@pytest.fixture(scope="module")
def one_rank(a14b_model: Path) -> dict:
    reference = reference_run(CONFIG, a14b_model)  # asserts both experts ran one step each
    return {"latents": reference.latents}


def test_a14b_patch_parallel_vae_equals_whole_decode(a14b_model: Path, one_rank: dict) -> None:
    """The A14B checkpoint's AutoencoderKLWan, decoding the two-expert latents: two row bands equal the whole decode."""
    decoder = WanStreamingDecoder(a14b_model, CPU, torch.float32)
    latents = one_rank["latents"]
    with torch.no_grad():
        whole = decoder.vae.decode(latents / decoder.latents_std + decoder.latents_mean).sample
    assert whole.shape == (1, 3, SPEC.num_frames, SPEC.height, SPEC.width)
    assert whole.std() > 0.05, "the decoded video is flat: the comparison would prove little"
    for rank, decoded in enumerate(run_ranks(_vae_ranks, 2, str(a14b_model), latents)):
        difference = (decoded - whole).abs().max().item()
        print(f"patch-parallel VAE rank {rank}: max abs diff {difference:.2e} against the whole decode")
        assert decoded.shape == whole.shape
        assert difference <= TOLERANCE, f"rank {rank}: max abs difference {difference:.2e} > {TOLERANCE}"


def test_a14b_interpolation_keeps_decoded_frames_in_place(a14b_model: Path, one_rank: dict, tmp_path: Path) -> None:
    """Optical-flow and RIFE interpolation of the A14B frames, fed as the VAE streams them (1 frame, then 4)."""
    session = WanStreamingDecoder(a14b_model, CPU, torch.float32).session()
    latents = one_rank["latents"]
    chunks = [session.decode_next(latents[:, :, t : t + 1]).numpy() for t in range(latents.shape[2])]
    assert [len(chunk) for chunk in chunks] == [1, 4]
    frames = np.concatenate(chunks)
    assert frames.std() > 1.0, "the decoded frames are flat: interpolating them would prove little"
    rife = load_rife(_save_random_rife(tmp_path), CPU)
    for exp in (1, 2):
        flow = StreamingInterpolator(exp)
        learned = StreamingRifeInterpolator(exp, rife)
        for name, interpolator, whole in (
            ("flow", flow, interpolate_sequence(frames, exp)),
            ("rife", learned, RifeInterpolator(rife).interpolate_sequence(frames, exp)),
        ):
            out = np.concatenate([interpolator.push(chunk) for chunk in chunks])
            levels = np.abs(out.astype(np.int16) - whole.astype(np.int16)).max()
            inserted = np.abs(out[1 : 2**exp].astype(np.int16) - frames[0].astype(np.int16)).max()
            print(
                f"{name} exp {exp}: {len(out)} frames, streamed vs whole {levels} levels, first inserted frame "
                f"differs from frame 0 by up to {inserted} levels"
            )
            assert out.shape == (output_frame_count(len(frames), exp), *frames.shape[1:])
            np.testing.assert_array_equal(out[:: 2**exp], frames)
            assert levels <= (0 if name == "flow" else 1), f"{name} exp {exp}: streamed differs by {levels} levels"
            assert inserted > 0, f"{name} exp {exp}: the inserted frames repeat frame 0"


def _save_random_rife(directory: Path) -> Path:
    path = directory / "flownet.pkl"
    torch.save(random_state_dict(seed=0), path)
    return path
