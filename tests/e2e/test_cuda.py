"""The CUDA-only code paths on one GPU, each checked against the same code on the CPU in float32.

CI and the development machines have no GPU, so these tests carry the `cuda` marker, which the default
`pytest` run deselects (pyproject.toml). On a GPU machine: `make test-gpu`, i.e.
`pytest -m cuda -s tests/e2e/test_cuda.py`. Selected on a machine without CUDA they fail, saying so, instead
of skipping: a GPU run that quietly ran nothing must not look like a pass.

What runs only on CUDA, and so only here:
- the LSE-returning attention kernel that Ulysses / Ring attention and their merge use
  (stagekit/parallel/attention.py: memory-efficient SDPA with a padded bias and a padded LSE);
- weight-only fp8/int8 quantization with the weights made on the GPU, torchao's or our own modules;
- GGUF weights loaded onto the GPU, packed, and dequantized there on every call;
- CPU offload with pinned host memory, and diffusers' layerwise offload prefetching on a side stream;
- multi-thread weight loading straight onto the GPU (the cast runs there);
- a rank group on NCCL;
- the whole cluster with every stage on `--device cuda` (bfloat16, the default there).

Each test prints one line per measurement, starting with `[cuda]` (max abs error, relative error,
bytes, peak memory, backend), so the log of a run (`-s`) is the evidence of what was checked.

STAGEDIFF_CUDA_TESTS_ON_CPU=1 runs the same tests on the CPU instead, only to check the tests' own
plumbing on a machine without a GPU; the checks that only mean something on a GPU (peak GPU memory,
pinned host memory, the side stream) are then left out. A GPU run never sets it.
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from torch import nn
from transformers import UMT5EncoderModel

from dit_svc.offload import ModuleOffloader, ResidencyCounter, apply_offload, group_offload_units
from dit_svc.quantization import (
    METHODS,
    WeightOnlyQuantizedLinear,
    expected_storage_dtype,
    linear_layer_names,
    parameter_bytes,
    quantize_transformer,
    torchao_available,
    weight_storage_dtype,
)
from families.gguf import gguf_file_name, write_gguf
from families.init_model import init_model
from families.wan.components import build_transformer
from families.wan.gguf_names import original_name
from families.wan.parallel import WanSequenceParallelAttnProcessor
from stagekit.gguf import load_gguf_transformer
from stagekit.parallel.attention import (
    _gather_sequence,
    _merge_block,
    attention_with_lse,
    heads_to_ranks,
    ranks_to_heads,
    usp_attention,
)
from stagekit.parallel.mesh import ParallelConfig, build_mesh, device_type_for
from stagekit.parallel.sequence_parallel import SequenceParallelState
from stagekit.weights import load_pretrained, load_stats
from tests.helpers.references import reference_frames

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

CPU = torch.device("cpu")
ON_CPU = os.environ.get("STAGEDIFF_CUDA_TESTS_ON_CPU") == "1"


def cuda_device() -> torch.device:
    """The GPU a test runs on, with its peak-memory counter reset. The first call of every test: where
    there is no GPU it fails the test (never skips it)."""
    if ON_CPU:
        return CPU
    if not torch.cuda.is_available():
        pytest.fail(
            "CUDA is not available: tests marked `cuda` need an NVIDIA GPU; run them on a GPU machine with "
            "`make test-gpu` (they are deselected from the default run)",
            pytrace=False,
        )
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # With an index: tensors report cuda:0, and `torch.device("cuda") != torch.device("cuda", 0)`.
    return torch.device("cuda", torch.cuda.current_device())


def on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def on_device(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def report(what: str, **numbers: object) -> None:
    """One line of evidence in the run's log."""
    formatted = " ".join(f"{k}={v:.3e}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items())
    print(f"[cuda] {what}: {formatted}", flush=True)


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.detach().float().cpu() - expected.detach().float().cpu()).abs().max().item()


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float32 on the CPU."""
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    return ((actual - expected).norm() / expected.norm()).item()


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}MiB"


def allocated(device: torch.device) -> int:
    gc.collect()
    return torch.cuda.memory_allocated(device) if on_gpu(device) else 0


def warm_baseline(device: torch.device) -> int:
    """GPU memory allocated once cuBLAS and cuBLASLt have made their workspaces (kept per stream after the
    first matmul, tens of MiB on Hopper, counted as allocated): the zero that models' bytes are measured from."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(64, 64, device=device, dtype=dtype)
        torch.nn.functional.linear(x @ x, x, x[0])  # a plain matmul, then one with a bias epilogue
    return allocated(device)


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if on_gpu(device) else 0


def reset_peak(device: torch.device) -> None:
    if on_gpu(device):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


@pytest.fixture(scope="module", autouse=True)
def environment_report() -> None:
    """What the run ran on: the first lines of the log."""
    import diffusers
    import grpc
    import transformers
    from google import protobuf

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    torchao = "absent (the native backend serves 'auto')"
    if torchao_available():
        from importlib.metadata import version

        torchao = version("torchao")
    report(
        "environment",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        gpu=gpu.replace(" ", "_"),
        diffusers=diffusers.__version__,
        transformers=transformers.__version__,
        grpcio=grpc.__version__,
        protobuf=protobuf.__version__,
        torchao=torchao.replace(" ", "_"),
        on_cpu_dry_run=ON_CPU,
    )


# ---------------------------------------------------------------------------------------------
# Models and inputs.


@pytest.fixture(scope="module")
def small_transformer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `small` preset's transformer (12 blocks, 57 MiB in bf16): its weights dominate GPU memory over
    the activations of a small input, so peak-memory differences measure where the weights are."""
    directory = tmp_path_factory.mktemp("small-transformer")
    torch.manual_seed(0)
    build_transformer("small").save_pretrained(directory)
    return directory


def load_transformer(directory: Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """As the DiT stage loads it: straight onto the device, the fp32-kept modules in fp32."""
    return load_pretrained(WanTransformer3DModel, directory, device=device, dtype=dtype, num_threads=4)


def transformer_inputs(model: nn.Module, device: torch.device, seed: int = 0, latent=(1, 16, 3, 16, 16)) -> dict:
    """Inputs drawn on the CPU (the same numbers on every device), in the model's dtype."""
    generator = torch.Generator().manual_seed(seed)
    dtype = model.dtype
    return dict(
        hidden_states=torch.randn(*latent, generator=generator).to(device, dtype),
        timestep=torch.tensor([700], device=device),
        encoder_hidden_states=torch.randn(1, 12, model.config.text_dim, generator=generator).to(device, dtype),
        return_dict=False,
    )


@torch.no_grad()
def run_transformer(model: nn.Module, device: torch.device, seed: int = 0, **kwargs) -> torch.Tensor:
    return model(**transformer_inputs(model, device, seed, **kwargs))[0]


# ---------------------------------------------------------------------------------------------
# a. The attention kernel of sequence parallelism: out and LSE from the CUDA kernel, and the merge.

# Max abs error of an attention output against the CPU float32 result on the same (rounded) inputs.
# Outputs are averages of N(0, 1) values (|out| < ~2): bf16 rounds them to 2^-8 relative, fp16 to
# 2^-11 (the CPU kernel in these dtypes: at most 8e-3 and 7e-4). The float32 bound, like the LSE's
# (accumulated in float32 whatever the inputs), leaves room for a kernel that multiplies in TF32; a
# wrong result is off by 0.1 or more.
OUT_ATOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 5e-3}
LSE_ATOL = 5e-3
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]


def qkv(batch: int, query_len: int, key_len: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, query_len, heads, head_dim, generator=generator).to(dtype)
    key = torch.randn(batch, key_len, heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(batch, key_len, heads, head_dim, generator=generator).to(dtype)
    return query, key, value


def padding_mask(batch: int, key_len: int, seed: int = 1) -> torch.Tensor:
    """Row 0: no padding; row 1: ~40% of the keys padded at random; row 2 (if any): every key padded."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, key_len, dtype=torch.bool)
    mask[1] = torch.rand(key_len, generator=generator) < 0.4
    mask[1, 0] = False
    if batch > 2:
        mask[2] = True
    return mask


def cpu_reference(query, key, value, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel (tested against fp64 in test_sequence_parallel.py) in float32 on the same rounded inputs."""
    return attention_with_lse(query.float(), key.float(), value.float(), mask)


@pytest.mark.parametrize("head_dim", [8, 48, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_with_lse_kernel_matches_cpu(dtype: torch.dtype, head_dim: int) -> None:
    """The memory-efficient kernel with the LSE: 37 queries and 45 keys, neither a multiple of the bias
    alignment (16) nor of the LSE padding (32); a padding bias on some keys, and a row of padding only,
    which must give out = 0 and lse = -inf (never NaN), so that merging it adds nothing."""
    device = cuda_device()
    query, key, value = qkv(3, 37, 45, 4, head_dim, dtype)
    for masked in (False, True):
        mask = padding_mask(3, 45) if masked else None
        expected_out, expected_lse = cpu_reference(query, key, value, mask)
        out, lse = attention_with_lse(query.to(device), key.to(device), value.to(device), on_device(mask, device))
        assert out.dtype == dtype and out.shape == query.shape and out.device == device
        assert lse.dtype == torch.float32 and lse.shape == (3, 37, 4)
        real = slice(0, 2) if masked else slice(None)  # row 2 of the masked case has no key
        out_error, lse_error = max_abs(out[real], expected_out[real]), max_abs(lse[real], expected_lse[real])
        report(f"attention_with_lse {dtype} D={head_dim} masked={masked}", out_max_abs=out_error, lse_max_abs=lse_error)
        assert not out.isnan().any() and not lse.isnan().any()
        assert out_error <= OUT_ATOL[dtype] and lse_error <= LSE_ATOL
        if masked:
            assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))


def attention_ring_on_one_device(query, key, value, mask, world: int) -> torch.Tensor:
    """What `ring_attention` computes on each of `world` ranks, all on one device: the sequence padded to a
    multiple of `world` as the sequence-parallel hooks pad it (zeros, masked out), rank r holding chunk r of
    the queries and merging K/V blocks in the order the ring brings them (its own, then r-1, r-2, ...)."""
    batch, seq_len = query.shape[:2]
    local = -(-seq_len // world)
    pad = local * world - seq_len

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(batch, pad, *x.shape[2:])], dim=1)

    query, key, value = padded(query), padded(key), padded(value)
    if mask is not None or pad:
        real = mask if mask is not None else torch.zeros(batch, seq_len, dtype=torch.bool, device=query.device)
        mask = torch.cat([real, torch.ones(batch, pad, dtype=torch.bool, device=query.device)], dim=1)

    def chunk(x: torch.Tensor | None, rank: int) -> torch.Tensor | None:
        return None if x is None else x[:, rank * local : (rank + 1) * local]

    outputs = []
    for rank in range(world):
        out, lse = None, None
        for hop in range(world):
            source = (rank - hop) % world
            block_out, block_lse = attention_with_lse(
                chunk(query, rank), chunk(key, source), chunk(value, source), chunk(mask, source)
            )
            out, lse = _merge_block(out, lse, block_out, block_lse)
        outputs.append(out.to(query.dtype))
    return torch.cat(outputs, dim=1)[:, :seq_len]


def attention_heads_split_on_one_device(query, key, value, mask, degree: int) -> torch.Tensor:
    """What Ulysses computes, on one device: each rank's group of H / degree heads over the whole sequence
    (strided head slices, as the kernel sees them after the all-to-all's reshape), concatenated back."""
    heads = query.shape[2] // degree
    parts = [
        attention_with_lse(*(x[:, :, g * heads : (g + 1) * heads] for x in (query, key, value)), mask)[0]
        for g in range(degree)
    ]
    return torch.cat(parts, dim=2)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_ring_and_ulysses_merge_on_cuda_equal_full_attention(dtype: torch.dtype) -> None:
    """Ring attention's exact merge through the LSE, on the CUDA kernel's half-precision blocks: 45 tokens
    over 2 and 4 simulated ranks (so the last block is partly padding), with and without a key mask, equal
    the CPU float32 attention over the whole sequence; the Ulysses head split likewise."""
    device = cuda_device()
    query, key, value = qkv(2, 45, 45, 4, 64, dtype, seed=3)
    for masked in (False, True):
        mask = padding_mask(2, 45, seed=4) if masked else None
        expected, _ = cpu_reference(query, key, value, mask)
        q, k, v, m = query.to(device), key.to(device), value.to(device), on_device(mask, device)
        for world in (2, 4):
            ring = attention_ring_on_one_device(q, k, v, m, world)
            ulysses = attention_heads_split_on_one_device(q, k, v, m, world)
            errors = {"ring": max_abs(ring, expected), "ulysses": max_abs(ulysses, expected)}
            report(f"merge {dtype} world={world} masked={masked}", **{f"{k}_max_abs": e for k, e in errors.items()})
            assert ring.dtype == dtype and not ring.isnan().any()
            assert max(errors.values()) <= OUT_ATOL[dtype], errors
        # usp_attention without groups: the single-rank path of the processor the DiT runs.
        single = usp_attention(q, k, v, None, None, m)
        assert max_abs(single, expected) <= OUT_ATOL[dtype]


def use_sequence_parallel_processor(model: nn.Module, tokens: int) -> None:
    """Every self-attention through WanSequenceParallelAttnProcessor -> usp_attention -> attention_with_lse,
    at degree 1: one GPU holds no second rank, but the processor and the kernel are what every rank runs."""
    state = SequenceParallelState(ulysses_group=None, ring_group=None, ulysses_size=1, ring_size=1, shard_index=0)
    state.seq_len = tokens  # set by the plan's split hook at degree > 1
    processor = WanSequenceParallelAttnProcessor(state)
    for block in model.blocks:
        block.attn1.set_processor(processor)


# bf16 through a random Wan transformer against float32: about 1% relative (measured on the CPU).
TRANSFORMER_BF16_RTOL = 4e-2


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_wan_forward_with_the_sequence_parallel_processor_on_cuda(
    tiny_model: Path, small_transformer_dir: Path, preset: str
) -> None:
    """A Wan transformer forward in bf16 on the GPU with our attention processor (head dims 8 and 48, 45
    tokens) against the same checkpoint on the CPU in float32, and against diffusers' own CUDA attention."""
    device = cuda_device()
    directory = tiny_model / "transformer" if preset == "tiny" else small_transformer_dir
    latent = (1, 16, 3, 6, 10)  # 3 x 3 x 5 = 45 tokens after the (1, 2, 2) patch
    expected = run_transformer(load_transformer(directory, CPU, torch.float32), CPU, latent=latent)
    model = load_transformer(directory, device, torch.bfloat16)
    default = run_transformer(model, device, latent=latent)
    use_sequence_parallel_processor(model, tokens=45)
    ours = run_transformer(model, device, latent=latent)
    errors = dict(ours_vs_cpu_fp32=relative(ours, expected), diffusers_vs_cpu_fp32=relative(default, expected))
    errors["ours_vs_diffusers"] = relative(ours, default)
    report(f"wan forward {preset} bf16", **errors)
    assert ours.dtype == torch.bfloat16 and not ours.isnan().any()
    assert errors["ours_vs_cpu_fp32"] <= TRANSFORMER_BF16_RTOL
    assert errors["ours_vs_diffusers"] <= TRANSFORMER_BF16_RTOL


def denoise_inputs(text_dim: int):
    from stagekit.denoise import DenoiseSpec

    generator = torch.Generator().manual_seed(5)
    spec = DenoiseSpec(height=64, width=64, num_frames=9, num_inference_steps=3, guidance_scale=5.0, seed=11)
    conditioning = {
        "prompt_embeds": torch.randn(1, 16, text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 16, text_dim, generator=generator),
    }
    return spec, conditioning


def denoise(denoiser, text_dim: int) -> torch.Tensor:
    spec, conditioning = denoise_inputs(text_dim)
    return denoiser.denoise(spec, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)


# A whole denoising loop (3 steps, CFG) in bf16 against float32, errors compounding over the steps. The
# same loop on the CPU in bf16 measured 1.0e-2 (plain), 1.1e-2 (int8) and 1.9e-2 (fp8) relative.
DENOISE_BF16_RTOL = 5e-2
DENOISE_CASES = {
    # name: (checkpoint fixture, ModelOptions keyword arguments, relative tolerance)
    "plain": ("tiny_model", {}, DENOISE_BF16_RTOL),
    "module-offload": ("tiny_model", {"offload": "module"}, DENOISE_BF16_RTOL),
    "layerwise-offload": ("tiny_model", {"offload": "layerwise"}, DENOISE_BF16_RTOL),
    "layerwise-2-blocks": ("tiny_model", {"offload": "layerwise", "offload_blocks": 2}, DENOISE_BF16_RTOL),
    "int8": ("tiny_model", {"quantization": "int8"}, 6e-2),
    "fp8+layerwise": ("tiny_model", {"quantization": "fp8", "offload": "layerwise"}, 1e-1),
    "a14b+module-offload": ("a14b_model", {"offload": "module"}, DENOISE_BF16_RTOL),
}


@pytest.mark.parametrize("case", list(DENOISE_CASES))
def test_wan_denoiser_on_cuda_matches_cpu_float32(case: str, request: pytest.FixtureRequest) -> None:
    """The DiT stage's denoising loop (WanDenoiser with its memory options, as `stagediff serve dit` builds
    it) on the GPU in bf16, against the same loop on the CPU in float32: scheduler, CFG, the experts of
    Wan2.2 A14B switching at the boundary, quantization then offload applied on the device."""
    from dit_svc.model_options import ModelOptions
    from families.wan.denoise import WanDenoiser

    device = cuda_device()
    fixture, options, tolerance = DENOISE_CASES[case]
    model_dir = request.getfixturevalue(fixture)
    reference = WanDenoiser(model_dir, CPU, torch.float32)
    expected = denoise(reference, reference.text_dim)
    denoiser = WanDenoiser(model_dir, device, torch.bfloat16, options=ModelOptions(**options))
    reset_peak(device)
    latents = denoise(denoiser, denoiser.text_dim)
    error = relative(latents, expected)
    backend = ("torchao" if torchao_available() else "native") if "quantization" in options else "-"
    report(f"denoiser {case}", rel_vs_cpu_fp32=error, peak=mib(peak(device)), quantization_backend=backend)
    assert latents.dtype == torch.float32 and latents.device.type == device.type
    assert error <= tolerance


# ---------------------------------------------------------------------------------------------
# b. Weight-only quantization with the weights made on the GPU.


@pytest.mark.parametrize("backend", ["native", "auto"])
@pytest.mark.parametrize("method", METHODS)
def test_weight_only_quantization_on_cuda(small_transformer_dir: Path, method: str, backend: str) -> None:
    """Quantizing the small DiT on the GPU: every linear layer stored in 8 bits on the device, parameter
    bytes and allocated GPU memory about halved, the output close to bf16's and to the CPU's float32.
    'auto' is torchao where it imports, our WeightOnlyQuantizedLinear otherwise: the line says which."""
    device = cuda_device()
    expected = run_transformer(load_transformer(small_transformer_dir, CPU, torch.float32), CPU)
    model = load_transformer(small_transformer_dir, device, torch.bfloat16)
    unquantized = run_transformer(model, device)
    names = linear_layer_names(model)
    before = allocated(device)
    quantization = quantize_transformer(model, method, [], backend=backend)
    after = allocated(device)
    quantized = run_transformer(model, device)

    errors = dict(rel_vs_bf16=relative(quantized, unquantized), rel_vs_cpu_fp32=relative(quantized, expected))
    report(
        f"quantize {method} backend={backend}",
        ran=quantization.backend,
        param_bytes=f"{mib(quantization.bytes_before)}->{mib(quantization.bytes_after)}",
        ratio=quantization.ratio,
        gpu_allocated=f"{mib(before)}->{mib(after)}",
        **errors,
    )
    assert quantization.backend == ("torchao" if backend == "auto" and torchao_available() else "native")
    assert quantization.quantized == names
    for name in names:
        layer = model.get_submodule(name)
        assert weight_storage_dtype(layer) == expected_storage_dtype(method), name
        assert all(p.device == device for p in layer.parameters()), name
    assert quantization.bytes_after <= 0.55 * quantization.bytes_before
    if on_gpu(device):
        # The bf16 weights are freed, not kept beside their 8-bit copies.
        assert before - after >= 0.8 * (quantization.bytes_before - quantization.bytes_after)
    # bf16 itself moves the output by ~0.5%; 8-bit weights add at most a few percent (as on the CPU).
    assert errors["rel_vs_bf16"] < (0.05 if method == "fp8" else 0.02)
    assert errors["rel_vs_cpu_fp32"] < (0.06 if method == "fp8" else 0.03)


@pytest.mark.parametrize("method", METHODS)
def test_native_quantized_weights_equal_the_cpu_ones(small_transformer_dir: Path, method: str) -> None:
    """Our module quantizes on the GPU what it quantizes on the CPU: the same scales and 8-bit weights,
    up to the rounding of a value that falls on a step's boundary."""
    device = cuda_device()
    cpu_model = load_transformer(small_transformer_dir, CPU, torch.bfloat16)
    gpu_model = load_transformer(small_transformer_dir, device, torch.bfloat16)
    names = linear_layer_names(cpu_model)
    quantize_transformer(cpu_model, method, [], backend="native")
    quantize_transformer(gpu_model, method, [], backend="native")
    same_scales, scales, same_weights, weights, worst_steps = 0, 0, 0, 0, 0.0
    for name in names:
        ours, theirs = gpu_model.get_submodule(name), cpu_model.get_submodule(name)
        assert isinstance(ours, WeightOnlyQuantizedLinear) and ours.weight.device == device, name
        same_scales += int((ours.weight_scale.cpu() == theirs.weight_scale).sum())
        scales += theirs.weight_scale.numel()
        same_weights += int((ours.weight.cpu().view(torch.uint8) == theirs.weight.view(torch.uint8)).sum())
        weights += theirs.weight.numel()
        step = theirs.weight_scale.float()[:, None]
        difference = (ours.dequantized_weight(torch.float32).cpu() - theirs.dequantized_weight(torch.float32)).abs()
        worst_steps = max(worst_steps, (difference / step).max().item())
    report(
        f"native {method} weights gpu vs cpu",
        identical_scales=same_scales / scales,
        identical_weights=same_weights / weights,
        worst_in_steps=worst_steps,
    )
    assert same_scales / scales >= 0.999 and same_weights / weights >= 0.999
    # fp8 steps grow with the magnitude: one value rounded to its neighbour moves by up to 32 x scale.
    assert worst_steps <= (1.0 if method == "int8" else 32.0)


@pytest.mark.parametrize("quant_type", ["Q8_0", "Q4_0"])
def test_gguf_transformer_on_cuda(small_transformer_dir: Path, tmp_path: Path, quant_type: str) -> None:
    """A GGUF file loaded onto the GPU as the DiT stage loads it (stagekit/gguf.py): the linear weights stay
    packed there (GPU memory about the packed bytes, not bf16's), and the bf16 output is the CPU float32 output
    of the same file within bf16's rounding."""
    from diffusers.quantizers.gguf.utils import GGUFLinear

    device = cuda_device()
    component = tmp_path / "transformer"
    component.mkdir()
    shutil.copy(small_transformer_dir / "config.json", component)
    write_gguf(small_transformer_dir, quant_type, original_name, "wan", out=component / gguf_file_name(quant_type))
    expected = run_transformer(
        load_gguf_transformer(WanTransformer3DModel, component, device=CPU, dtype=torch.float32), CPU
    )
    before = allocated(device)
    model = load_gguf_transformer(WanTransformer3DModel, component, device=device, dtype=torch.bfloat16)
    loaded = allocated(device) - before
    output = run_transformer(model, device)
    layers = [module for module in model.modules() if isinstance(module, GGUFLinear)]
    error = relative(output, expected)
    report(
        f"gguf {quant_type}",
        layers=len(layers),
        param_bytes=mib(parameter_bytes(model)),
        gpu_allocated=mib(loaded),
        rel_vs_cpu_fp32=error,
    )
    assert len(layers) == 12 * 10  # every linear of the 12 blocks
    assert all(layer.weight.device == device and layer.weight.dtype == torch.uint8 for layer in layers)
    if on_gpu(device):
        assert loaded <= 1.1 * parameter_bytes(model)
    assert error < 0.02


# ---------------------------------------------------------------------------------------------
# c. CPU offload: pinned host memory, the side stream, and what stays on the GPU.


def model_bytes(model: nn.Module) -> int:
    return parameter_bytes(model) + sum(b.numel() * b.element_size() for b in model.buffers())


def test_module_offload_keeps_one_expert_on_the_gpu(small_transformer_dir: Path) -> None:
    """Two experts (as Wan2.2 A14B's) loaded onto the GPU, then offloaded module-wise: they wait in pinned
    host memory, the one computing is on the GPU, outputs equal the resident experts', and the peak GPU
    memory of the same sequence of forwards is about one expert lower."""
    device = cuda_device()
    baseline = warm_baseline(device)
    experts = [load_transformer(small_transformer_dir, device, torch.bfloat16) for _ in range(2)]
    for expert, seed in zip(experts, (1, 2), strict=True):  # two different experts
        with torch.no_grad():
            for param in expert.parameters():
                param.mul_(1 + 0.01 * seed)
    size = model_bytes(experts[0])
    sequence = (0, 0, 1, 1, 0)  # high-noise steps, low-noise steps, a new request
    reset_peak(device)
    expected = [run_transformer(experts[i], device, seed=step) for step, i in enumerate(sequence)]
    peak_resident = peak(device)

    offloader = ModuleOffloader(device)
    for expert in experts:
        apply_offload(expert, "module", device, offloader=offloader)
    after_offload = allocated(device) - baseline
    hosts = [host for unit in offloader.units.values() for host in unit._host.values()]
    counter = ResidencyCounter(list(offloader.units.values()), experts, device)
    reset_peak(device)
    errors = []
    for step, i in enumerate(sequence):
        out = run_transformer(experts[i], device, seed=step)
        errors.append(max_abs(out, expected[step]))
        assert offloader.active is offloader.units[experts[i]]
        assert all(p.device == device for p in experts[i].parameters())
        assert all(p.device == CPU for p in experts[1 - i].parameters())
    peak_offloaded = peak(device)
    report(
        "module offload",
        expert=mib(size),
        peak_resident=mib(peak_resident),
        peak_offloaded=mib(peak_offloaded),
        allocated_after_offload=mib(after_offload),
        pinned=all(h.is_pinned() for h in hosts) if on_gpu(device) else "n/a",
        max_abs=max(errors),
        onloads=counter.onloads,
    )
    assert max(errors) == 0.0
    assert counter.violations == [] and counter.max_resident_blocks == 1 and counter.onloads == 3
    if on_gpu(device):
        assert all(h.is_pinned() for h in hosts), "host copies must be pinned for asynchronous copies"
        assert after_offload < 0.2 * size
        assert peak_offloaded <= peak_resident - 0.8 * size
    offloader.offload_all()
    assert allocated(device) - baseline <= after_offload + 2**20
    counter.close()


@pytest.mark.parametrize("blocks", [1, 2])
def test_layerwise_offload_prefetches_on_a_side_stream(small_transformer_dir: Path, blocks: int) -> None:
    """diffusers' block-level group offloading as the DiT applies it: with one block per group the next
    block is copied on a side stream while the current one computes. Outputs equal the resident model's,
    no layer computes with its weights off the GPU, at most two groups are resident, and the peak GPU
    memory of a forward drops by most of the model."""
    device = cuda_device()
    baseline = warm_baseline(device)
    model = load_transformer(small_transformer_dir, device, torch.bfloat16)
    size = model_bytes(model)
    reset_peak(device)
    expected = [run_transformer(model, device, seed=seed) for seed in (0, 1)]
    peak_resident = peak(device)

    handle = apply_offload(model, "layerwise", device, blocks_per_group=blocks)
    assert handle.use_stream == (on_gpu(device) and blocks == 1)
    units = group_offload_units(model)
    counter = ResidencyCounter(units, list(model.blocks), device)
    after_offload = allocated(device) - baseline
    reset_peak(device)
    errors = [max_abs(run_transformer(model, device, seed=seed), expected[seed]) for seed in (0, 1)]
    peak_offloaded = peak(device)
    report(
        f"layerwise offload blocks={blocks}",
        use_stream=handle.use_stream,
        model=mib(size),
        peak_resident=mib(peak_resident),
        peak_offloaded=mib(peak_offloaded),
        allocated_after_offload=mib(after_offload),
        max_resident_blocks=counter.max_resident_blocks,
        max_abs=max(errors),
    )
    assert max(errors) == 0.0
    assert counter.violations == [] and counter.leaf_calls > 0
    assert counter.max_resident_blocks <= 2 * blocks
    if on_gpu(device):
        assert after_offload < 0.2 * size
        assert peak_offloaded <= peak_resident - 0.5 * size
    counter.close()


@pytest.mark.parametrize("mode", ["module", "layerwise"])
@pytest.mark.parametrize("backend", ["native", "auto"])
@pytest.mark.parametrize("method", METHODS)
def test_quantized_then_offloaded_on_cuda(small_transformer_dir: Path, method: str, backend: str, mode: str) -> None:
    """`--quantization` with an offload flag: quantized on the GPU, then its 8-bit weights (torchao tensor
    subclasses, or our modules' int8/float8 parameters) pinned and moved like any others; outputs equal the
    quantized model's without offload."""
    device = cuda_device()
    baseline = warm_baseline(device)
    reference = load_transformer(small_transformer_dir, device, torch.bfloat16)
    quantization = quantize_transformer(reference, method, [], backend=backend)
    expected = [run_transformer(reference, device, seed=seed) for seed in (0, 1)]
    del reference
    model = load_transformer(small_transformer_dir, device, torch.bfloat16)
    quantize_transformer(model, method, [], backend=backend)
    before = allocated(device) - baseline
    handle = apply_offload(model, mode, device, blocks_per_group=1)
    after = allocated(device) - baseline
    errors = [max_abs(run_transformer(model, device, seed=seed), expected[seed]) for seed in (0, 1)]
    report(
        f"quantized {method} ({quantization.backend}) then {mode} offload",
        use_stream=getattr(handle, "use_stream", "n/a"),
        gpu_allocated=f"{mib(before)}->{mib(after)}",
        max_abs=max(errors),
    )
    assert max(errors) == 0.0
    if on_gpu(device):
        assert after < 0.3 * before


# ---------------------------------------------------------------------------------------------
# d. Multi-thread weight loading straight onto the GPU.

COMPONENTS = {"transformer": WanTransformer3DModel, "vae": AutoencoderKLWan, "text_encoder": UMT5EncoderModel}


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint in small shards, so the reader's threads split the work between files."""
    return init_model("wan-t2v", "tiny", tmp_path_factory.mktemp("models") / "tiny-sharded", seed=0, shard_size=20_000)


def from_pretrained(cls: type, directory: Path, dtype: torch.dtype) -> nn.Module:
    kwargs = {"dtype": dtype} if cls is UMT5EncoderModel else {"torch_dtype": dtype}
    return cls.from_pretrained(directory, **kwargs).eval()


@torch.no_grad()
def component_forward(name: str, model: nn.Module, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    dtype = model.dtype
    if name == "transformer":
        hidden = torch.randn(1, 16, 2, 8, 8, generator=generator).to(device, dtype)
        text = torch.randn(1, 7, 32, generator=generator).to(device, dtype)
        return model(hidden, torch.tensor([500], device=device), text, return_dict=False)[0]
    if name == "vae":
        return model.decode(torch.randn(1, 16, 2, 4, 4, generator=generator).to(device, dtype)).sample
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(COMPONENTS))
def test_multithread_load_onto_cuda_equals_from_pretrained(sharded_model: Path, name: str, dtype: torch.dtype) -> None:
    """`load_pretrained(device=cuda)` with 4 threads, each copying its shards to the GPU and casting there,
    gives exactly `from_pretrained(...).to(cuda)`: every parameter and buffer (dtype, device, value), the
    fp32-kept modules, tied weights; and the same values as loading onto the CPU."""
    device = cuda_device()
    directory = sharded_model / name
    cls = COMPONENTS[name]
    ours = load_pretrained(cls, directory, device=device, dtype=dtype, num_threads=4)
    theirs = from_pretrained(cls, directory, dtype).to(device)
    on_cpu = load_pretrained(cls, directory, device="cpu", dtype=dtype, num_threads=4)
    compared = 0
    for kind in ("named_parameters", "named_buffers"):
        mine = dict(getattr(ours, kind)(remove_duplicate=False))
        reference = dict(getattr(theirs, kind)(remove_duplicate=False))
        cpu_loaded = dict(getattr(on_cpu, kind)(remove_duplicate=False))
        assert mine.keys() == reference.keys() == cpu_loaded.keys(), kind
        for key, value in reference.items():
            assert mine[key].dtype == value.dtype and mine[key].device == value.device == device, key
            assert torch.equal(mine[key], value), key
            assert torch.equal(mine[key].cpu(), cpu_loaded[key]), key
            compared += 1
    if name == "text_encoder":
        assert ours.encoder.embed_tokens.weight is ours.shared.weight
    error = max_abs(component_forward(name, ours, device), component_forward(name, theirs, device))
    stats = load_stats(ours)
    report(
        f"load_pretrained {name} {dtype}",
        tensors=compared,
        bytes=stats.total_bytes,
        shards=len(stats.shards),
        seconds=stats.seconds,
        forward_max_abs=error,
    )
    assert stats.threads == 4 and len(stats.shards) >= 3
    assert error == 0.0


# ---------------------------------------------------------------------------------------------
# f. The whole cluster on the GPU.

STAGES = ("text-encoder", "dit", "vae", "interp")
E2E_CASE = dict(
    prompt="a red fox running through snow", negative_prompt="blurry, low quality", height=64, width=64,
    num_frames=9, steps=2, guidance=5.0, seed=0,
)  # fmt: skip


def test_cluster_on_cuda_matches_wan_pipeline_on_cpu(tiny_model: Path, reference_pipeline, tmp_path: Path) -> None:
    """`stagediff up` (its default compose file) with every stage on `--device cuda` (bfloat16 there by
    default), started as the CLI starts it (`python -m stagediff.cli`), generates frames close to
    WanPipeline's on the CPU in float32;
    with `--interp-exp 1` the interpolator keeps the originals in place. On the CPU the same comparison in
    bf16 measured a mean of 0.4 levels (of 255) and a maximum of 5."""
    from stagediff import Client
    from stagediff.local.supervisor import LocalCluster

    device = cuda_device()
    # The default compose file is the CPU variant, whose env file hides every GPU from its stages
    # (CUDA_VISIBLE_DEVICES empty, STAGEDIFF_DEVICE=cpu); the cluster's env and the flags win over it.
    environment = {"STAGEDIFF_DEVICE": device.type}
    if on_gpu(device):
        environment["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", str(device.index))
    cluster = LocalCluster(
        tiny_model,
        threads_per_stage=2,
        log_dir=tmp_path / "logs",
        env=environment,
        extra_args={stage: ["--device", device.type] for stage in STAGES},
    )
    cluster.start(timeout=240)
    try:
        with Client(cluster.endpoint) as client:
            info = client.cluster_info()
            arguments = dict(
                negative_prompt=E2E_CASE["negative_prompt"], height=E2E_CASE["height"], width=E2E_CASE["width"],
                num_frames=E2E_CASE["num_frames"], num_inference_steps=E2E_CASE["steps"],
                guidance_scale=E2E_CASE["guidance"], seed=E2E_CASE["seed"],
            )  # fmt: skip
            result = client.generate(E2E_CASE["prompt"], **arguments)
            interpolated = client.generate(E2E_CASE["prompt"], interp_exp=1, **arguments)
    finally:
        cluster.stop()
    devices = {status.info.stage: status.info.device for status in info.stages}
    expected = reference_frames(reference_pipeline, **E2E_CASE)
    difference = np.abs(result.frames.astype(np.int16) - expected.astype(np.int16))
    originals = np.abs(interpolated.frames[::2].astype(np.int16) - result.frames.astype(np.int16))
    report(
        "cluster on cuda vs WanPipeline cpu fp32",
        devices=",".join(f"{stage}:{device}" for stage, device in sorted(devices.items())),
        levels_mean=float(difference.mean()),
        levels_p99=float(np.percentile(difference, 99)),
        levels_max=int(difference.max()),
        timings=",".join(f"{k}:{v:.2f}s" for k, v in sorted(result.timings.items())),
        interpolated_frames=len(interpolated.frames),
        originals_max=int(originals.max()),
    )
    assert all(devices[stage].startswith(device.type) for stage in ("text-encoder", "dit", "vae")), devices
    assert result.frames.shape == expected.shape and result.frames.dtype == np.uint8
    # Frames that went wrong on the GPU would differ by tens of levels everywhere (the model is random).
    assert difference.mean() <= 2.0 and difference.max() <= 40
    assert len(interpolated.frames) == 2 * (E2E_CASE["num_frames"] - 1) + 1
    assert originals.max() <= 2


# ---------------------------------------------------------------------------------------------
# e. A rank group on NCCL (last: it initialises torch.distributed in this process, and a hang inside
# NCCL, which no signal interrupts, ends the run with every thread's stack after 180 s).


@pytest.mark.timeout(180, method="thread")
def test_single_rank_nccl_group_runs_the_dit(tiny_model: Path) -> None:
    """The DiT's rank group (dit_svc/group.py over services/rank_group/) with one rank on a GPU: it
    picks NCCL, builds the DeviceMesh on cuda, and the collectives the parallel DiT uses (broadcast of the
    go-on flag, all-gather of sequence shards, the Ulysses all-to-all) run on it; the group's denoising
    equals the CPU's."""
    from dit_svc.config import DenoiserBuild
    from dit_svc.group import DenoiserGroup
    from dit_svc.model_options import ModelOptions
    from families.wan.denoise import WanDenoiser
    from stagekit.parallel.cfg import agree_to_continue

    device = cuda_device()
    reference = WanDenoiser(tiny_model, CPU, torch.float32)
    expected = denoise(reference, reference.text_dim)
    group = DenoiserGroup(tiny_model, device, torch.bfloat16, 0, DenoiserBuild(ParallelConfig(), ModelOptions()))
    try:
        rank_device = group.group.device
        backend = dist.get_backend()
        mesh = build_mesh(ParallelConfig(), device_type_for(rank_device))
        flags = (agree_to_continue(True, rank_device), agree_to_continue(False, rank_device))
        shard = torch.randn(2, 6, 4, 8, device=rank_device)
        ulysses = mesh["ulysses"].get_group()
        gathered = _gather_sequence(shard, ulysses)
        (scattered,) = heads_to_ranks([shard], ulysses)
        round_trip = ranks_to_heads(scattered, ulysses)
        spec, conditioning = denoise_inputs(group.text_dim)
        latents, _ = group.denoise_request(spec, conditioning, on_step=lambda s, t: None, cancelled=lambda: False)
    finally:
        group.close()
    error = relative(latents, expected)
    report(
        "rank group world=1",
        backend=backend,
        device=rank_device,
        mesh=tuple(mesh.mesh.shape),
        rel_vs_cpu_fp32=error,
    )
    assert backend == ("nccl" if on_gpu(device) else "gloo") and rank_device.type == device.type
    assert flags == (True, False)
    assert torch.equal(gathered, shard) and torch.equal(round_trip, shard)
    assert error <= DENOISE_BF16_RTOL
    assert not dist.is_initialized()
