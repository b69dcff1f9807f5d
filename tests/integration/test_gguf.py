"""GGUF transformer weights: written as published files are, loaded as diffusers loads them, under Ulysses,
Ring and CFG-parallel, and bad files refused at startup naming the problem. (That the GGUF denoiser of each
Wan family equals the diffusers pipeline loading the files with `from_single_file` is tests/integration/
test_family_features.py's, from the families' tester configs.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

from dit_svc.config import DitConfig
from dit_svc.model_options import ModelOptions
from families.gguf import gguf_file_name
from families.wan.denoise import WanDenoiser
from families.wan.gguf_names import original_name
from stagediff.cli import main as cli_main
from stagekit.denoise import DenoiseSpec
from stagekit.gguf import check_gguf_file, gguf_file, load_gguf_transformer
from stagekit.parallel import ParallelConfig
from stagekit.parallel.launch import run_ranks
from tests.helpers.feature_mixins import WanT2VTesterConfig
from tests.helpers.feature_mixins.gguf import gguf_checkpoint
from tests.helpers.serving import parse_serve

TOLERANCE = 1e-4
TYPES = ("Q8_0", "Q4_0")
# 48x80x5 -> 2 x 3 x 5 = 30 tokens, which Ulysses over 2 ranks splits unevenly.
SPEC = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=2, guidance_scale=5.0, seed=3)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gguf_models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny checkpoint with its transformer as a GGUF file, per type (the GGUF feature tests' files)."""
    return {
        quant_type: gguf_checkpoint(WanT2VTesterConfig(), tiny_model, quant_type, tmp_path_factory)
        for quant_type in TYPES
    }


def _conditioning(text_dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {
        "prompt_embeds": torch.randn(1, 16, text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 16, text_dim, generator=generator),
    }


def _gguf_latents(model: Path, parallel: ParallelConfig | None = None) -> torch.Tensor:
    denoiser = WanDenoiser(model, CPU, torch.float32, parallel=parallel, options=ModelOptions(quantization="gguf"))
    conditioning = _conditioning(denoiser.text_dim)
    return denoiser.denoise(SPEC, conditioning, on_step=lambda i, n: None, cancelled=lambda: False)


def test_written_names_are_the_original_wans_and_diffusers_renames_them_back(gguf_models) -> None:
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(
            WanTransformer3DModel.load_config(gguf_models["Q8_0"] / "transformer")
        )
    keys = list(model.state_dict())
    assert original_name("blocks.0.attn1.to_q.weight") == "blocks.0.self_attn.q.weight"
    assert original_name("blocks.1.norm2.weight") == "blocks.1.norm3.weight"  # the cross-attention norm
    assert original_name("proj_out.weight") == "head.head.weight"
    assert sorted(convert_wan_transformer_to_diffusers({original_name(k): None for k in keys})) == sorted(keys)

    reader = gguf.GGUFReader(gguf_models["Q4_0"] / "transformer" / gguf_file_name("Q4_0"))
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    assert types["blocks.0.self_attn.q.weight"] == "Q4_0" and types["blocks.1.ffn.2.weight"] == "Q4_0"
    assert types["blocks.0.self_attn.q.bias"] == "F32" and types["head.head.weight"] == "F32"
    assert sorted(path.name for path in (gguf_models["Q4_0"] / "transformer").iterdir()) == [
        "config.json",
        gguf_file_name("Q4_0"),
    ]


def _mapped_file(address: int) -> str | None:
    """The file mapped at `address` in this process (/proc/self/maps), or None for anonymous memory."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, _, _, _, *path = line.split(maxsplit=5)
        start, end = (int(bound, 16) for bound in span.split("-"))
        if start <= address < end:
            return path[0] if path else None
    return None


def test_loaded_weights_are_views_of_the_file_and_writing_them_leaves_it_unchanged(gguf_models) -> None:
    """The weights stay in the file's pages (copy-on-write), so writing one copies its page and never the file."""
    component = gguf_models["Q4_0"] / "transformer"
    before = gguf_file(component).read_bytes()
    model = load_gguf_transformer(WanTransformer3DModel, component, device=CPU, dtype=torch.float32)
    weight = model.blocks[0].attn1.to_q.weight
    assert _mapped_file(weight.data_ptr()) == str(gguf_file(component))
    original = weight.clone()
    with torch.no_grad():
        weight.add_(1)
    assert gguf_file(component).read_bytes() == before
    reloaded = load_gguf_transformer(WanTransformer3DModel, component, device=CPU, dtype=torch.float32)
    assert torch.equal(reloaded.blocks[0].attn1.to_q.weight.as_tensor(), original.as_tensor())


# Each type under Ulysses (the acceptance layout), and the 4-bit one also under Ring and CFG parallelism.
LAYOUTS = [
    ("Q8_0", "ulysses2", ParallelConfig(ulysses_degree=2)),
    ("Q4_0", "ulysses2", ParallelConfig(ulysses_degree=2)),
    ("Q4_0", "ring2", ParallelConfig(ring_degree=2)),
    ("Q4_0", "cfg2", ParallelConfig(cfg_degree=2)),
]


def _layout_latents(rank: int, world_size: int, models: dict[str, str]) -> list[torch.Tensor]:
    return [_gguf_latents(Path(models[quant_type]), config) for quant_type, _, config in LAYOUTS]


def test_gguf_under_parallel_layouts_equals_one_rank(gguf_models) -> None:
    expected = {quant_type: _gguf_latents(model) for quant_type, model in gguf_models.items()}
    per_rank = run_ranks(_layout_latents, 2, {name: str(model) for name, model in gguf_models.items()})
    for rank, results in enumerate(per_rank):
        for (quant_type, layout, _), latents in zip(LAYOUTS, results, strict=True):
            difference = (latents - expected[quant_type]).abs().max().item()
            assert difference <= TOLERANCE, f"{quant_type} {layout} rank {rank}: {difference:.2e}"


def test_gguf_transformer_under_offload_and_compile(gguf_models) -> None:
    """Offload moves the packed weights and leaves the output unchanged; compiled blocks stay within float32
    rounding of eager ones (inductor fuses the dequantization into the matmul's inputs)."""
    from dit_svc.compile import compile_repeated_blocks
    from dit_svc.offload import ModuleOffloader, apply_offload
    from tests.helpers.offload import run

    component = gguf_models["Q4_0"] / "transformer"

    def load() -> WanTransformer3DModel:
        return load_gguf_transformer(WanTransformer3DModel, component, device=CPU, dtype=torch.float32)

    eager = run(load())
    for mode in ("module", "layerwise"):
        model = load()
        apply_offload(
            model, mode, CPU, blocks_per_group=1, offloader=ModuleOffloader(CPU) if mode == "module" else None
        )
        assert torch.equal(run(model), eager), mode
    model = load()
    compile_repeated_blocks([model])
    assert (run(model) - eager).abs().max().item() <= 1e-3


# The k-quants published files mostly use, and the byte offsets of each block's float16 scales (the rest of a
# block, packed sub-block scales and 4- or 6-bit values, is valid whatever its bytes).
K_QUANT_SCALES = {"Q4_K": (0, 2), "Q6_K": (208,)}


def _k_quant_checkpoint(folder: Path, quant_type: str) -> Path:
    """A one-block transformer 256 wide (k-quants pack 256 values per block) whose blocks' linear weights are random
    but valid `quant_type` blocks, written as a GGUF file beside its config (the gguf package writes no k-quants)."""
    qtype = gguf.GGMLQuantizationType[quant_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    model = WanTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=128,
        text_dim=32,
        ffn_dim=256,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
    )
    component = folder / "transformer"
    model.save_config(component)
    writer = gguf.GGUFWriter(component / f"model-{quant_type}.gguf", arch="wan")
    for key, tensor in model.state_dict().items():
        if key.startswith("blocks.") and key.endswith(".weight") and tensor.ndim == 2:
            rows, columns = tensor.shape
            blocks = rng.integers(0, 256, size=(rows * columns // block_size, type_size), dtype=np.uint8)
            for offset in K_QUANT_SCALES[quant_type]:
                scale = rng.uniform(1e-3, 4e-3, size=len(blocks)).astype(np.float16)
                blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
            writer.add_tensor(original_name(key), blocks.reshape(rows, -1), raw_dtype=qtype)
        else:
            writer.add_tensor(original_name(key), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return component


@pytest.mark.parametrize("quant_type", sorted(K_QUANT_SCALES))
def test_k_quant_files_load_and_dequantize_as_the_gguf_reference(tmp_path, quant_type) -> None:
    """A k-quant file passes the checks and loads; each GGUFLinear's weight is what gguf's own numpy
    dequantization (an independent implementation) makes of the file's blocks."""
    from diffusers.quantizers.gguf.utils import GGUFLinear, dequantize_gguf_tensor

    component = _k_quant_checkpoint(tmp_path, quant_type)
    path = gguf_file(component)
    assert check_gguf_file(path, WanTransformer3DModel, component).types[quant_type] == 10
    model = load_gguf_transformer(WanTransformer3DModel, component, device=CPU, dtype=torch.float32)
    stored = {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    layers = {name: module for name, module in model.named_modules() if isinstance(module, GGUFLinear)}
    assert len(layers) == 10
    for name, layer in layers.items():
        tensor = stored[original_name(f"{name}.weight")]
        expected = torch.from_numpy(gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).copy())
        # diffusers multiplies a k-quant block's scales out in float16, gguf in float32: equal to float16's precision.
        torch.testing.assert_close(dequantize_gguf_tensor(layer.weight).float(), expected, rtol=2e-3, atol=2e-3)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 1, 4, 4),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32),
        return_dict=False,
    )
    with torch.no_grad():
        assert torch.isfinite(model(**inputs)[0]).all()


def test_a_bad_gguf_file_stops_the_stage_at_startup(gguf_models, tmp_path) -> None:
    model = _bad_checkpoint(gguf_models, tmp_path, "truncated")
    command = [sys.executable, "-m", "stagediff.cli", "serve", "dit", "--model", str(model), "--port", "0"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert "stagediff serve dit:" in completed.stderr and "not a readable GGUF file" in completed.stderr


def _rewrite(source: Path, target: Path, rename=lambda name: name, drop=(), relabel=None, quantize=()) -> None:
    """A copy of a GGUF file with tensors renamed, dropped, quantized (`quantize`: float32 ones to Q8_0), or with
    every quantized tensor relabelled as another type (`relabel`, zero bytes of that type's size)."""
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch="wan")
    for tensor in reader.tensors:
        if tensor.name in drop:
            continue
        name, data = rename(tensor.name), np.array(tensor.data)
        if tensor.name in quantize:
            writer.add_tensor(name, gguf.quants.quantize(data, q8_0), raw_dtype=q8_0)
        elif tensor.tensor_type.name == "F32":
            writer.add_tensor(name, data)
        elif relabel is not None:
            rows, columns = (int(n) for n in reversed(tensor.shape))
            block, size = gguf.GGML_QUANT_SIZES[relabel]
            writer.add_tensor(name, np.zeros((rows, columns // block * size), np.uint8), raw_dtype=relabel)
        else:
            writer.add_tensor(name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


DAMAGES = {
    "renamed": dict(rename=lambda name: name.replace("cross_attn", "crossattn")),
    "missing": dict(drop=("blocks.1.ffn.2.weight",)),
    "unsupported": dict(relabel=gguf.GGMLQuantizationType.Q8_1),
    "quantized modulation": dict(quantize=("blocks.0.modulation",)),
}


def _bad_checkpoint(gguf_models: dict[str, Path], tmp_path: Path, damage: str) -> Path:
    model = tmp_path / "bad"
    shutil.copytree(gguf_models["Q8_0"], model)
    path = gguf_file(model / "transformer")
    good = tmp_path / "good.gguf"
    shutil.move(path, good)
    if damage == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    else:
        _rewrite(good, path, **DAMAGES[damage])
    return model


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("truncated", ["not a readable GGUF file", "truncated"]),
        ("renamed", ["tensor names do not match", "missing", "blocks.0.attn2.to_k.weight", "crossattn"]),
        ("missing", ["1 of the model's tensors are missing", "blocks.1.ffn.net.2.weight"]),
        ("unsupported", ["is stored as Q8_1", "cannot be dequantized", "Q4_K"]),
        ("quantized modulation", ["blocks.0.scale_shift_table", "is quantized but is not a linear layer's weight"]),
    ],
)
def test_bad_gguf_files_are_refused_at_startup(gguf_models, tmp_path, damage, words) -> None:
    model = _bad_checkpoint(gguf_models, tmp_path, damage)
    with pytest.raises(SystemExit) as raised:
        DitConfig.from_args(parse_serve(["dit", "--model", str(model)]))
    message = str(raised.value)
    assert message.startswith("stagediff serve dit: ") and str(model / "transformer") in message
    for word in words:
        assert word in message, message
    with pytest.raises(ValueError, match=words[0]):
        check_gguf_file(gguf_file(model / "transformer"), WanTransformer3DModel, model / "transformer")


def test_gguf_is_chosen_by_the_file_and_refused_where_it_cannot_work(
    tiny_model, gguf_models, a14b_model, tmp_path
) -> None:
    q8, lora_dir = str(gguf_models["Q8_0"]), str(tmp_path / "adapters")
    (tmp_path / "adapters").mkdir()
    assert DitConfig.from_args(parse_serve(["dit", "--model", q8])).options.quantization == "gguf"
    assert (
        DitConfig.from_args(parse_serve(["dit", "--model", q8, "--quantization", "gguf"])).options.quantization
        == "gguf"
    )
    # Safetensors and a GGUF file side by side: the safetensors unless --quantization says otherwise.
    both = tmp_path / "both"
    shutil.copytree(tiny_model, both)
    shutil.copy(gguf_file(gguf_models["Q8_0"] / "transformer"), both / "transformer")
    for flags, expected in (([], None), (["--quantization", "fp8"], "fp8"), (["--quantization", "gguf"], "gguf")):
        assert DitConfig.from_args(parse_serve(["dit", "--model", str(both), *flags])).options.quantization == expected
    refusals = [
        ([q8, "--quantization", "fp8"], ["holds GGUF weights only", "--quantization gguf"]),
        ([str(tiny_model), "--quantization", "gguf"], ["holds no .gguf file", "--gguf Q8_0"]),
        ([q8, "--tensor-parallel-size", "2"], ["--quantization gguf cannot be combined", "--tensor-parallel-size"]),
        ([q8, "--use-hsdp"], ["--quantization gguf cannot be combined", "--use-hsdp"]),
        ([q8, "--ignored-layers", "proj_out"], ["--ignored-layers needs --quantization {fp8,int8}"]),
        ([str(a14b_model), "--quantization", "gguf"], ["a14b-tiny/transformer holds no .gguf file"]),
        (
            [q8, "--lora-dir", lora_dir],
            ["--lora-dir (adapters per request) cannot be combined with --quantization gguf"],
        ),
        ([q8, "--lora-dir", lora_dir, "--lora", "a", "--max-loras-per-request", "0"], ["--lora cannot be combined"]),
    ]
    for flags, words in refusals:
        with pytest.raises(SystemExit) as raised:
            DitConfig.from_args(parse_serve(["dit", "--model", *flags]))
        for word in words:
            assert word in str(raised.value), (flags, str(raised.value))


def test_init_model_writes_a_gguf_checkpoint(tmp_path, capsys) -> None:
    out = tmp_path / "q5"
    argv = ["init-model", "--family", "wan-t2v", "--preset", "tiny", "--out", str(out), "--gguf", "Q5_0"]
    assert cli_main(argv) == 0
    contents = check_gguf_file(gguf_file(out / "transformer"), WanTransformer3DModel, out / "transformer")
    assert contents.types["Q5_0"] == 20 and "F32" in contents.types
    assert not list((out / "transformer").glob("*.safetensors"))

    refused = [
        "init-model",
        "--family",
        "qwen-image",
        "--preset",
        "tiny",
        "--out",
        str(tmp_path / "q"),
        "--gguf",
        "Q8_0",
    ]
    assert cli_main(refused) == 2
    assert "no GGUF layout" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
