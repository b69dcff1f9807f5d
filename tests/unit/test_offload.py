"""CPU offload: outputs unchanged, at most the configured blocks resident, invalid flag combinations refused.

On this CPU-only machine the onload device is the offload device, so "resident" is the
offload machinery's own state: `ResidencyCounter` wraps each group's onload_/offload_ and
checks, from a pre-hook on every layer that holds weights, that the layer computes only
while its group is onloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from torch import nn

from dit_svc.config_checks import validate_offload_flags
from dit_svc.offload import (
    ModuleOffloader,
    ResidencyCounter,
    apply_offload,
    group_offload_units,
)
from dit_svc.quantization import quantize_transformer, torchao_available
from families.wan.decode import WanStreamingDecoder
from tests.helpers.offload import run

CPU = torch.device("cpu")


def load(tiny_model: Path) -> nn.Module:
    return WanTransformer3DModel.from_pretrained(tiny_model / "transformer", torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("mode, blocks", [("module", 1), ("layerwise", 1), ("layerwise", 2)])
def test_transformer_output_unchanged(tiny_model: Path, mode: str, blocks: int) -> None:
    expected = [run(load(tiny_model), seed) for seed in (0, 1)]
    model = load(tiny_model)
    apply_offload(model, mode, CPU, blocks_per_group=blocks)
    for seed in (0, 1):  # twice: the second forward runs on what the first one offloaded
        assert torch.equal(run(model, seed), expected[seed])


@pytest.mark.parametrize("backend", ["native", "torchao"])
@pytest.mark.parametrize("mode", ["module", "layerwise"])
def test_offload_of_a_quantized_transformer(tiny_model: Path, mode: str, backend: str) -> None:
    """Quantize first (on the device), then offload: the quantized weights move like any other."""
    assert backend != "torchao" or torchao_available(), "torchao is a declared dependency; install the project"
    reference = load(tiny_model)
    quantize_transformer(reference, "int8", [], backend=backend)
    model = load(tiny_model)
    quantize_transformer(model, "int8", [], backend=backend)
    apply_offload(model, mode, CPU, blocks_per_group=1)
    for seed in (0, 1):
        assert torch.equal(run(model, seed), run(reference, seed))


def decode(decoder: WanStreamingDecoder, latents: torch.Tensor, offloader: ModuleOffloader | None = None):
    session = decoder.session()
    frames = []
    for t in range(latents.shape[2]):
        if offloader is None:
            frames.append(session.decode_next(latents[:, :, t : t + 1]))
        else:
            with offloader.resident(decoder.vae):  # the streaming decode calls vae.decoder, not vae.forward
                frames.append(session.decode_next(latents[:, :, t : t + 1]))
    return torch.cat(frames)


@pytest.mark.parametrize("mode", ["module", "layerwise"])
def test_vae_frames_unchanged(tiny_model: Path, mode: str) -> None:
    latents = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    expected = decode(WanStreamingDecoder(tiny_model, CPU, torch.float32), latents)
    decoder = WanStreamingDecoder(tiny_model, CPU, torch.float32)
    handle = apply_offload(decoder.vae, mode, CPU)
    if mode == "layerwise":
        counter = ResidencyCounter(group_offload_units(decoder.vae), [], CPU)
        assert torch.equal(decode(decoder, latents), expected)
        assert counter.leaf_calls > 0 and counter.violations == []
    else:
        assert torch.equal(decode(decoder, latents, handle), expected)


@pytest.mark.parametrize("blocks", [1, 2])
def test_layerwise_keeps_at_most_n_blocks_resident(tiny_model: Path, blocks: int) -> None:
    model = load(tiny_model)
    expected = run(load(tiny_model))
    apply_offload(model, "layerwise", CPU, blocks_per_group=blocks)
    units = group_offload_units(model)
    num_blocks = len(model.blocks)
    # One group per `blocks` blocks, plus the parameters outside the blocks.
    assert len(units) == -(-num_blocks // blocks) + 1
    counter = ResidencyCounter(units, list(model.blocks), CPU)
    assert counter.onloaded == set()  # everything starts offloaded

    for _ in range(2):
        assert torch.equal(run(model), expected)
        assert counter.onloaded == set()  # and is offloaded again after each forward

    assert counter.violations == []
    assert counter.leaf_calls > 0
    assert counter.max_resident_blocks == min(blocks, num_blocks)
    assert counter.onloads == counter.offloads == 2 * len(units)
    counter.close()


def test_counter_sees_a_layer_computing_while_offloaded(tiny_model: Path) -> None:
    """The residency check can fail: a block's submodule called directly bypasses its group's onload."""
    model = load(tiny_model)
    apply_offload(model, "layerwise", CPU, blocks_per_group=1)
    counter = ResidencyCounter(group_offload_units(model), list(model.blocks), CPU)
    with torch.no_grad():
        model.blocks[0].norm2(torch.randn(1, 4, model.config.num_attention_heads * model.config.attention_head_dim))
    assert counter.violations == ["norm2 computed while its group was offloaded"]
    assert counter.onloads == 0


def test_module_offload_keeps_one_expert_resident(tiny_model: Path) -> None:
    """Two experts (as Wan2.2 A14B's transformer and transformer_2): only the one computing is on the device."""
    expected = run(load(tiny_model))
    experts = [load(tiny_model), load(tiny_model)]
    offloader = ModuleOffloader(CPU)
    for expert in experts:
        apply_offload(expert, "module", CPU, offloader=offloader)
    counter = ResidencyCounter(list(offloader.units.values()), experts, CPU)

    for expert in (0, 0, 1, 1, 0):  # high-noise steps, then low-noise, then a new request
        assert torch.equal(run(experts[expert]), expected)
        assert offloader.active is offloader.units[experts[expert]]
        assert counter.resident_blocks == 1
    assert counter.violations == []
    assert counter.max_resident_blocks == 1
    assert counter.onloads == 3  # a switch moves the model; steps of the same expert move nothing
    assert counter.offloads == 2
    offloader.offload_all()
    assert counter.resident_blocks == 0 and counter.offloads == 3


def test_offload_flags() -> None:
    assert validate_offload_flags(False, False) is None
    assert validate_offload_flags(True, False) == "module"
    assert validate_offload_flags(False, True, offload_blocks=3) == "layerwise"
    with pytest.raises(ValueError, match="--enable-cpu-offload and --enable-layerwise-offload cannot be combined"):
        validate_offload_flags(True, True)
    with pytest.raises(ValueError, match="--enable-layerwise-offload cannot be combined with --tensor-parallel-size 2"):
        validate_offload_flags(False, True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--enable-cpu-offload cannot be combined with --use-hsdp: HSDP already"):
        validate_offload_flags(True, False, use_hsdp=True)
    with pytest.raises(ValueError, match="--offload-blocks: 0 is not allowed"):
        validate_offload_flags(False, True, offload_blocks=0)
