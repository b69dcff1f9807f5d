"""Qwen-Image: memory features and multi-thread loading on the Qwen components.

Offload and quantization run through the Qwen denoiser the DiT stage serves (QwenImageDenoiser with the
stage's ModelOptions) on the tiny checkpoint; loading compares `services.weights.load_pretrained` with each
library's `from_pretrained`, and the three Qwen stages with QwenImagePipeline's components.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
from transformers import Qwen2_5_VLForConditionalGeneration

from dit_svc.denoise import DenoiseSpec, make_denoiser
from dit_svc.model_options import ModelOptions
from dit_svc.offload import ModuleOffloader, ResidencyCounter, apply_offload, group_offload_units
from dit_svc.quantization import (
    expected_storage_dtype,
    linear_layer_names,
    parameter_bytes,
    quantize_transformer,
    weight_storage_dtype,
)
from families.init_model import init_model
from families.qwen_image.decode import QwenImageDecoder
from families.qwen_image.denoise import QwenImageDenoiser, QwenTextEmbeds
from families.qwen_image.encode import QwenPromptEncoder
from services.weights import load_pretrained, load_stats

CPU = torch.device("cpu")
# 64x48 -> 4 x 3 packed image tokens; two steps with true CFG: four transformer forwards.
SPEC = DenoiseSpec(height=64, width=48, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=0)
FORWARDS = 4
IGNORED = ("proj_out", "transformer_blocks.0.*", "time_text_embed.*")
COMPONENTS = {
    "transformer": QwenImageTransformer2DModel,
    "vae": AutoencoderKLQwenImage,
    "text_encoder": Qwen2_5_VLForConditionalGeneration,
}


def _conditioning(dim: int) -> dict[str, torch.Tensor]:
    """A prompt with a hole in its mask (so the mask reaches the transformer) and an unmasked negative prompt,
    as the DiT stage receives them."""
    generator = torch.Generator().manual_seed(0)
    conditioning = {
        "prompt_embeds": torch.randn(1, 7, dim, generator=generator),
        "prompt_embeds_mask": torch.tensor([[1, 1, 0, 1, 1, 1, 1]]),
        "negative_prompt_embeds": torch.randn(1, 5, dim, generator=generator),
    }
    assert QwenTextEmbeds.from_conditioning(conditioning, "prompt_embeds").mask is not None
    return conditioning


def denoise_counting_forwards(denoiser: QwenImageDenoiser) -> tuple[torch.Tensor, int]:
    """The final latents [1, C, 1, h, w] of SPEC, and how many transformer forwards ran."""
    calls = [0]
    handle = denoiser.transformer.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    conditioning = _conditioning(denoiser.text_dim)
    try:
        latents = denoiser.denoise(SPEC, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)
    finally:
        handle.remove()
    return latents, calls[0]


@pytest.fixture(scope="module")
def fp32_latents(qwen_model: Path) -> torch.Tensor:
    latents, forwards = denoise_counting_forwards(QwenImageDenoiser(qwen_model, CPU, torch.float32))
    assert forwards == FORWARDS and latents.std() > 0.1
    return latents


# ------------------------------------------------------------------------------------------- CPU offload


def test_qwen_module_offload_leaves_latents_unchanged(qwen_model: Path, fp32_latents: torch.Tensor) -> None:
    """`--enable-cpu-offload`: the same latents, and the transformer computes only while it is on the device."""
    offloaded = QwenImageDenoiser(qwen_model, CPU, torch.float32, options=ModelOptions(offload="module"))
    latents, forwards = denoise_counting_forwards(offloaded)
    assert forwards == FORWARDS and torch.equal(latents, fp32_latents)

    # The offloader apply_model_options gives the transformer, observed through a whole request.
    denoiser = QwenImageDenoiser(qwen_model, CPU, torch.float32)
    offloader = ModuleOffloader(CPU)
    apply_offload(denoiser.transformer, "module", CPU, offloader=offloader)
    counter = ResidencyCounter(list(offloader.units.values()), [denoiser.transformer], CPU)
    assert counter.onloaded == set()  # waits in CPU memory until its first forward
    latents, forwards = denoise_counting_forwards(denoiser)
    print(f"module offload: {counter.onloads} onloads, {counter.leaf_calls} layer calls, {forwards} forwards")
    assert forwards == FORWARDS and torch.equal(latents, fp32_latents)
    assert counter.violations == [] and counter.leaf_calls > 0
    assert counter.onloads == 1 and counter.offloads == 0  # the only model stays once it is on the device
    offloader.offload_all()
    assert counter.resident_blocks == 0
    counter.close()


@pytest.mark.parametrize("blocks", [1, 2])
def test_qwen_layerwise_offload_keeps_at_most_n_blocks_resident(
    qwen_model: Path, fp32_latents: torch.Tensor, blocks: int
) -> None:
    denoiser = QwenImageDenoiser(
        qwen_model, CPU, torch.float32, options=ModelOptions(offload="layerwise", offload_blocks=blocks)
    )
    transformer_blocks = list(denoiser.transformer.transformer_blocks)
    units = group_offload_units(denoiser.transformer)
    # One group per `blocks` transformer blocks, plus the parameters outside them (embedders, norm_out, proj_out).
    assert len(units) == math.ceil(len(transformer_blocks) / blocks) + 1
    counter = ResidencyCounter(units, transformer_blocks, CPU)
    assert counter.onloaded == set()

    latents, forwards = denoise_counting_forwards(denoiser)
    print(
        f"layerwise {blocks} block(s): at most {counter.max_resident_blocks} blocks resident, "
        f"{counter.onloads} onloads over {forwards} forwards, {counter.leaf_calls} layer calls"
    )
    assert forwards == FORWARDS and torch.equal(latents, fp32_latents)
    assert counter.violations == [] and counter.leaf_calls > 0
    assert counter.max_resident_blocks == min(blocks, len(transformer_blocks))
    assert counter.onloaded == set()  # offloaded again after each forward
    assert counter.onloads == counter.offloads == forwards * len(units)
    counter.close()


# ------------------------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("backend", ["native", "torchao"])
@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_qwen_quantized_parameter_bytes_and_ignored_layers(qwen_model: Path, method: str, backend: str) -> None:
    def load() -> torch.nn.Module:
        return QwenImageTransformer2DModel.from_pretrained(qwen_model / "transformer", torch_dtype=torch.bfloat16)

    model = load()
    bf16_bytes = parameter_bytes(model)
    names = linear_layer_names(model)
    report = quantize_transformer(model, method, [], backend=backend)
    print(f"{method} ({backend}): {report.summary()}")
    assert report.quantized == names and report.skipped == []
    assert report.bytes_before == bf16_bytes and report.bytes_after == parameter_bytes(model)
    assert report.bytes_after <= 0.55 * bf16_bytes, report.summary()

    model = load()
    before = {name: weight_storage_dtype(model.get_submodule(name)) for name in names}
    report = quantize_transformer(model, method, list(IGNORED), backend=backend)
    ignored = {name for name in names if name == "proj_out" or name.startswith(("transformer_blocks.0.", "time_text_"))}
    assert ignored and set(report.skipped) == ignored and set(report.quantized) == set(names) - ignored
    for name, dtype in before.items():
        stored = weight_storage_dtype(model.get_submodule(name))
        assert stored == (dtype if name in ignored else expected_storage_dtype(method)), name


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_qwen_quantized_denoiser_stays_close(qwen_model: Path, method: str) -> None:
    """`--quantization` through the Qwen denoiser (bf16, the stage's default backend): latents close to bf16's."""
    reference = QwenImageDenoiser(qwen_model, CPU, torch.bfloat16)
    expected, _ = denoise_counting_forwards(reference)
    noise = QwenImagePipeline._unpack_latents(
        reference.initial_noise(SPEC, torch.float32), SPEC.height, SPEC.width, reference.vae_scale_factor
    )
    # Relative to what the two steps changed (latents - noise): bf16 alone moves it by a few percent against fp32.
    change = (expected.float() - noise).norm()
    for ignored in ((), IGNORED):
        denoiser = QwenImageDenoiser(
            qwen_model, CPU, torch.bfloat16, options=ModelOptions(quantization=method, ignored_layers=ignored)
        )
        latents, forwards = denoise_counting_forwards(denoiser)
        relative = ((latents.float() - expected.float()).norm() / change).item()
        print(f"{method} ignoring {list(ignored)}: relative difference of the denoising update {relative:.4f}")
        assert forwards == FORWARDS
        assert relative < 0.05, f"{method} ignoring {list(ignored)}: relative difference {relative:.4f}"


def test_qwen_ignored_layers_are_checked_against_qwen_layer_names(qwen_model: Path) -> None:
    """The DiT's startup check reads QwenImage's own layer names: Wan's `blocks.*` matches nothing there."""
    from dit_svc.options import add_lora_arguments, add_memory_arguments, add_parallel_arguments, add_speed_arguments
    from dit_svc.service import model_options_from
    from services.stage_options import add_stage_arguments

    parser = argparse.ArgumentParser()
    add_stage_arguments(parser, default_port=0)
    add_parallel_arguments(parser)
    add_memory_arguments(parser)
    add_speed_arguments(parser)
    add_lora_arguments(parser)
    flags = ["--model", str(qwen_model), "--quantization", "int8", "--ignored-layers"]
    options = model_options_from(parser.parse_args([*flags, ",".join(IGNORED)]))
    assert options == ModelOptions("int8", IGNORED, None, 1)
    with pytest.raises(SystemExit) as raised:
        model_options_from(parser.parse_args([*flags, "blocks.0.*"]))
    message = str(raised.value)
    assert "pattern 'blocks.0.*' matches no linear layer" in message and "img_in" in message, message


# ------------------------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def sharded_qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        "qwen-image", "tiny", tmp_path_factory.mktemp("models") / "qwen-sharded", seed=0, shard_size=50_000
    )


def _reference(name: str, directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    kwargs = {"dtype": dtype} if name == "text_encoder" else {"torch_dtype": dtype}
    return COMPONENTS[name].from_pretrained(directory, **kwargs).eval()


@torch.no_grad()
def _forward(name: str, model: torch.nn.Module) -> torch.Tensor:
    """One deterministic forward pass of a component, in the model's dtype."""
    generator = torch.Generator().manual_seed(0)
    dtype = model.dtype
    if name == "transformer":
        config = model.config
        return model(
            hidden_states=torch.randn(1, 12, config.in_channels, generator=generator).to(dtype),
            encoder_hidden_states=torch.randn(1, 6, config.joint_attention_dim, generator=generator).to(dtype),
            encoder_hidden_states_mask=torch.tensor([[1, 1, 1, 1, 0, 1]]),
            timestep=torch.tensor([0.5]).to(dtype),
            img_shapes=[[(1, 3, 4)]],
            return_dict=False,
        )[0]
    if name == "vae":
        return model.decode(torch.randn(1, model.config.z_dim, 1, 4, 4, generator=generator).to(dtype)).sample
    ids = torch.randint(3, 1000, (1, 9), generator=generator)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states[-1]


def _assert_same_tensors(ours: torch.nn.Module, reference: torch.nn.Module, name: str) -> None:
    for kind in ("named_parameters", "named_buffers"):
        mine = dict(getattr(ours, kind)(remove_duplicate=False))
        theirs = dict(getattr(reference, kind)(remove_duplicate=False))
        assert mine.keys() == theirs.keys(), f"{name} {kind}: {sorted(mine.keys() ^ theirs.keys())}"
        for key, value in theirs.items():
            assert mine[key].dtype == value.dtype, f"{name}.{key}: {mine[key].dtype} != {value.dtype}"
            assert torch.equal(mine[key], value), f"{name}.{key}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_threads", [1, 4])
@pytest.mark.parametrize("name", list(COMPONENTS))
def test_qwen_components_load_like_from_pretrained(
    sharded_qwen_model: Path, name: str, num_threads: int, dtype: torch.dtype
) -> None:
    directory = sharded_qwen_model / name
    shards = len(list(directory.glob("*.safetensors")))
    assert shards >= 3, f"{name}: the checkpoint should be sharded ({shards} files)"
    reference = _reference(name, directory, dtype)
    ours = load_pretrained(COMPONENTS[name], directory, dtype=dtype, num_threads=num_threads)
    assert type(ours) is COMPONENTS[name] and not ours.training
    _assert_same_tensors(ours, reference, name)
    assert torch.equal(_forward(name, ours), _forward(name, reference)), name
    stats = load_stats(ours)
    print(f"{name} {dtype} {num_threads} thread(s): {stats.tensors} tensors from {len(stats.shards)} shards")
    assert stats.threads == num_threads and len(stats.shards) == shards


def test_qwen_stages_read_weights_with_their_load_threads(qwen_model: Path, qwen_pipeline) -> None:
    """Each Qwen stage reads its component with the stage's thread count and holds the pipeline's weights."""
    encoder = QwenPromptEncoder(qwen_model, "qwen", CPU, torch.float32, load_threads=3)
    decoder = QwenImageDecoder(qwen_model, CPU, torch.float32, load_threads=2)
    denoiser = make_denoiser(qwen_model, CPU, torch.float32, load_threads=1)
    for name, model, threads in (
        ("text_encoder", encoder.text_encoder, 3),
        ("vae", decoder.vae, 2),
        ("transformer", denoiser.transformer, 1),
    ):
        assert load_stats(model).threads == threads, name
        _assert_same_tensors(model, getattr(qwen_pipeline, name), name)

    embedding, cached = encoder.encode_one("a red fox in the snow", 512)
    expected, mask = qwen_pipeline.encode_prompt("a red fox in the snow", device=CPU)
    assert not cached and mask is None  # one text alone: no padding, as the pipeline leaves it
    assert torch.equal(embedding, expected[0])
