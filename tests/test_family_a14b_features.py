"""Wan2.2 A14B (two experts switched at boundary_ratio): the serving features wan-t2v has, on the A14B checkpoint.

Every DiT check runs two UniPC steps, 999 on `transformer` and 750 on `transformer_2` (the boundary is
0.875 * 1000), and counts the forward calls of each expert, so that a feature that silently dropped or
swapped an expert would fail. Parallel layouts (ring, tensor parallel, HSDP) and the patch-parallel VAE
share one spawn of two gloo ranks; their results are compared with one rank's in-process.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dit_svc.denoise import DenoiseSpec
from dit_svc.model_options import ModelOptions
from dit_svc.offload import ModuleOffloader, ResidencyCounter, apply_offload, group_offload_units
from dit_svc.parallel import ParallelConfig
from dit_svc.parallel.hsdp import local_parameter_bytes
from dit_svc.parallel.launch import run_ranks
from dit_svc.quantization import expected_storage_dtype, linear_layer_names, parameter_bytes, weight_storage_dtype
from families.wan.decode import WanStreamingDecoder
from families.wan.denoise import WanDenoiser
from interp_svc.interpolate import StreamingInterpolator, interpolate_sequence, output_frame_count
from interp_svc.rife import RifeInterpolator, StreamingRifeInterpolator, load_rife
from services.weights import load_stats
from tests.test_rife import random_state_dict
from vae_svc.patch_parallel import PatchParallelDecodeSession

CPU = torch.device("cpu")
TOLERANCE = 1e-4
# 48x80x5 -> latents [1, 16, 2, 6, 10]: 30 tokens (even over two ranks), 6 latent rows (3 per VAE rank).
SPEC = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=1)
# One step per expert, two forwards per step (the prompt and the negative prompt).
CALLS_PER_EXPERT = [2, 2]
LAYOUTS = [
    ("ring2", ParallelConfig(ring_degree=2)),
    ("tp2", ParallelConfig(tp_degree=2)),
    ("hsdp2", ParallelConfig(use_hsdp=True, hsdp_shard_size=2)),
]
IGNORED = ("proj_out", "blocks.0.*", "condition_embedder.*")


def _conditioning(text_dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
    }


def denoise_counting_experts(denoiser: WanDenoiser) -> tuple[torch.Tensor, list[int]]:
    """The final latents of SPEC, and how many forward calls each expert ran."""
    assert len(denoiser.experts) == 2, "the A14B checkpoint must load both experts"
    calls = [0, 0]
    handles = [
        expert.register_forward_pre_hook(lambda module, args, index=index: calls.__setitem__(index, calls[index] + 1))
        for index, expert in enumerate(denoiser.experts)
    ]
    conditioning = _conditioning(denoiser.text_dim)
    try:
        latents = denoiser.denoise(SPEC, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)
    finally:
        for handle in handles:
            handle.remove()
    return latents, calls


def _two_ranks(rank: int, world_size: int, model_dir: str, latents: torch.Tensor) -> dict:
    """Each layout's latents, expert calls and local parameter bytes; the patch-parallel decode of `latents`."""
    results: dict = {}
    for name, config in LAYOUTS:
        denoiser = WanDenoiser(model_dir, CPU, torch.float32, parallel=config)
        output, calls = denoise_counting_experts(denoiser)
        results[name] = {
            "latents": output,
            "calls": calls,
            "bytes": [local_parameter_bytes(expert) for expert in denoiser.experts],
        }
    session = PatchParallelDecodeSession(WanStreamingDecoder(model_dir, CPU, torch.float32))
    frames = [session.decode_next_float(latents[:, :, t : t + 1]) for t in range(latents.shape[2])]
    results["vae"] = torch.cat(frames, dim=2)
    return results


@pytest.fixture(scope="module")
def one_rank(a14b_model: Path) -> dict:
    denoiser = WanDenoiser(a14b_model, CPU, torch.float32)
    latents, calls = denoise_counting_experts(denoiser)
    assert calls == CALLS_PER_EXPERT, f"both experts must run one step each: {calls}"
    return {"latents": latents, "bytes": [parameter_bytes(expert) for expert in denoiser.experts]}


@pytest.fixture(scope="module")
def two_ranks(a14b_model: Path, one_rank: dict) -> list[dict]:
    return run_ranks(_two_ranks, 2, str(a14b_model), one_rank["latents"])


def _assert_layout_equals_one_rank(two_ranks: list[dict], one_rank: dict, name: str) -> None:
    for rank, results in enumerate(two_ranks):
        result = results[name]
        difference = (result["latents"] - one_rank["latents"]).abs().max().item()
        print(f"{name} rank {rank}: max abs diff {difference:.2e}, expert calls {result['calls']}")
        assert result["calls"] == CALLS_PER_EXPERT, f"{name} rank {rank}: expert calls {result['calls']}"
        assert difference <= TOLERANCE, f"{name} rank {rank}: max abs difference {difference:.2e} > {TOLERANCE}"


def test_a14b_ring_latents_equal_one_rank(two_ranks: list[dict], one_rank: dict) -> None:
    _assert_layout_equals_one_rank(two_ranks, one_rank, "ring2")


def test_a14b_tensor_parallel_latents_equal_one_rank(two_ranks: list[dict], one_rank: dict) -> None:
    _assert_layout_equals_one_rank(two_ranks, one_rank, "tp2")
    for rank, results in enumerate(two_ranks):
        for expert, (local, whole) in enumerate(zip(results["tp2"]["bytes"], one_rank["bytes"], strict=True)):
            print(f"tp2 rank {rank} expert {expert}: {local} of {whole} parameter bytes")
            assert local < 0.8 * whole, f"tp2 rank {rank} expert {expert}: holds {local} of {whole} bytes"


def test_a14b_hsdp_latents_equal_one_rank_and_halve_each_expert(two_ranks: list[dict], one_rank: dict) -> None:
    _assert_layout_equals_one_rank(two_ranks, one_rank, "hsdp2")
    for expert, whole in enumerate(one_rank["bytes"]):
        shards = [results["hsdp2"]["bytes"][expert] for results in two_ranks]
        print(f"hsdp2 expert {expert}: shards {shards} of {whole} parameter bytes")
        assert sum(shards) == whole, f"expert {expert}: shards add up to {sum(shards)} bytes, the expert has {whole}"
        assert max(shards) <= 0.55 * whole, f"expert {expert}: shards {shards} of {whole} bytes"


def test_a14b_patch_parallel_vae_equals_whole_decode(a14b_model: Path, two_ranks: list[dict], one_rank: dict) -> None:
    """The A14B checkpoint's AutoencoderKLWan, decoding the two-expert latents: two row bands equal the whole decode."""
    decoder = WanStreamingDecoder(a14b_model, CPU, torch.float32)
    latents = one_rank["latents"]
    with torch.no_grad():
        whole = decoder.vae.decode(latents / decoder.latents_std + decoder.latents_mean).sample
    assert whole.shape == (1, 3, SPEC.num_frames, SPEC.height, SPEC.width)
    assert whole.std() > 0.05, "the decoded video is flat: the comparison would prove little"
    for rank, results in enumerate(two_ranks):
        difference = (results["vae"] - whole).abs().max().item()
        print(f"patch-parallel VAE rank {rank}: max abs diff {difference:.2e} against the whole decode")
        assert results["vae"].shape == whole.shape
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


def test_a14b_module_offload_keeps_one_expert_resident(a14b_model: Path, one_rank: dict) -> None:
    """`--enable-cpu-offload` on the A14B denoiser: latents unchanged, one expert on the device at a time."""
    offloaded = WanDenoiser(a14b_model, CPU, torch.float32, options=ModelOptions(offload="module"))
    latents, calls = denoise_counting_experts(offloaded)
    assert calls == CALLS_PER_EXPERT and torch.equal(latents, one_rank["latents"])

    # The same shared offloader apply_model_options gives both experts, observed while the loop switches experts.
    denoiser = WanDenoiser(a14b_model, CPU, torch.float32)
    offloader = ModuleOffloader(CPU)
    for expert in denoiser.experts:
        apply_offload(expert, "module", CPU, offloader=offloader)
    counter = ResidencyCounter(list(offloader.units.values()), denoiser.experts, CPU)
    latents, calls = denoise_counting_experts(denoiser)
    print(f"module offload: {counter.onloads} onloads, {counter.offloads} offloads, {counter.leaf_calls} layer calls")
    assert calls == CALLS_PER_EXPERT and torch.equal(latents, one_rank["latents"])
    assert counter.violations == [] and counter.leaf_calls > 0
    assert counter.max_resident_blocks == 1
    # transformer for step 1, then transformer_2 replaces it at the boundary: the steps of one expert move nothing.
    assert (counter.onloads, counter.offloads) == (2, 1)
    assert offloader.active is offloader.units[denoiser.transformer_2]
    counter.close()


@pytest.mark.parametrize("blocks", [1, 2])
def test_a14b_layerwise_offload_keeps_n_blocks_per_expert(a14b_model: Path, one_rank: dict, blocks: int) -> None:
    denoiser = WanDenoiser(
        a14b_model, CPU, torch.float32, options=ModelOptions(offload="layerwise", offload_blocks=blocks)
    )
    units = [group_offload_units(expert) for expert in denoiser.experts]
    num_blocks = [len(expert.blocks) for expert in denoiser.experts]
    for expert_units, expert_blocks in zip(units, num_blocks, strict=True):
        assert len(expert_units) == math.ceil(expert_blocks / blocks) + 1  # plus the parameters outside the blocks
    all_blocks = [block for expert in denoiser.experts for block in expert.blocks]
    counter = ResidencyCounter([unit for expert_units in units for unit in expert_units], all_blocks, CPU)
    assert counter.onloaded == set()

    latents, calls = denoise_counting_experts(denoiser)
    difference = (latents - one_rank["latents"]).abs().max().item()
    print(
        f"layerwise {blocks} block(s): max abs diff {difference:.2e}, at most {counter.max_resident_blocks} blocks "
        f"resident, {counter.onloads} onloads, expert calls {calls}"
    )
    assert calls == CALLS_PER_EXPERT and torch.equal(latents, one_rank["latents"])
    assert counter.violations == [] and counter.leaf_calls > 0
    assert counter.max_resident_blocks == min(blocks, max(num_blocks))  # across both experts at once
    assert counter.onloaded == set()  # everything offloaded again after each forward
    # Each forward of an expert moves each of its groups once.
    expected = sum(len(expert_units) * n for expert_units, n in zip(units, calls, strict=True))
    assert counter.onloads == counter.offloads == expected
    counter.close()


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_a14b_quantized_experts_halve_bytes_and_stay_close(a14b_model: Path, method: str) -> None:
    """`--quantization` on both experts of a bf16 A14B denoiser: bytes, ignored layers' dtypes, latents close."""
    reference = WanDenoiser(a14b_model, CPU, torch.bfloat16)
    expected, _ = denoise_counting_experts(reference)
    noise = reference.initial_noise(SPEC)
    bf16_bytes = [parameter_bytes(expert) for expert in reference.experts]
    dtypes = [
        {name: weight_storage_dtype(expert.get_submodule(name)) for name in linear_layer_names(expert)}
        for expert in reference.experts
    ]

    quantized = WanDenoiser(a14b_model, CPU, torch.bfloat16, options=ModelOptions(quantization=method))
    ignoring = WanDenoiser(
        a14b_model, CPU, torch.bfloat16, options=ModelOptions(quantization=method, ignored_layers=IGNORED)
    )
    for index, expert in enumerate(quantized.experts):
        ratio = parameter_bytes(expert) / bf16_bytes[index]
        print(f"{method} expert {index}: parameters at {ratio:.1%} of bf16")
        assert ratio <= 0.55, f"{method} expert {index}: {ratio:.1%} of the bf16 bytes"
    for index, expert in enumerate(ignoring.experts):
        for name, before in dtypes[index].items():
            kept = name == "proj_out" or name.startswith(("blocks.0.", "condition_embedder."))
            stored = weight_storage_dtype(expert.get_submodule(name))
            assert stored == (before if kept else expected_storage_dtype(method)), f"expert {index} {name}: {stored}"

    # Relative to what the two steps changed (latents - noise), so the noise itself does not hide the error.
    # bf16 alone moves that change by about 2% against fp32; 8-bit weights may add a few percent more.
    change = (expected.float() - noise).norm()
    limit = 0.05
    for name, denoiser in (("all layers", quantized), ("ignored layers kept", ignoring)):
        latents, calls = denoise_counting_experts(denoiser)
        relative = ((latents.float() - expected.float()).norm() / change).item()
        print(f"{method} ({name}): relative difference of the denoising update {relative:.4f}, expert calls {calls}")
        assert calls == CALLS_PER_EXPERT
        assert relative < limit, f"{method} ({name}): relative difference {relative:.4f} >= {limit}"


@pytest.mark.parametrize("load_threads", [1, 4])
def test_a14b_experts_load_like_from_pretrained(a14b_model: Path, a14b_pipeline, load_threads: int) -> None:
    """Both experts, read by the DiT's multi-thread loader, hold exactly WanPipeline.from_pretrained's weights."""
    denoiser = WanDenoiser(a14b_model, CPU, torch.float32, load_threads=load_threads)
    for name, expert in zip(("transformer", "transformer_2"), denoiser.experts, strict=True):
        assert load_stats(expert).threads == load_threads, name
        reference = getattr(a14b_pipeline, name)
        ours, theirs = dict(expert.state_dict()), dict(reference.state_dict())
        assert ours.keys() == theirs.keys(), f"{name}: {sorted(ours.keys() ^ theirs.keys())}"
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), f"{name}.{key}"
    first, second = (dict(expert.named_parameters()) for expert in denoiser.experts)
    assert not torch.equal(first["blocks.0.attn1.to_q.weight"], second["blocks.0.attn1.to_q.weight"])
