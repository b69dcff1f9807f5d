"""Tensor parallelism and HSDP of WanTransformer3DModel on gloo ranks equal the single-rank transformer.

Each spawned run builds every configuration on every rank from the same seed,
computes the single-rank output in-process as the reference, applies the
parallel plan and compares; one run per world size keeps the spawn cost (the
imports) to two runs for the whole file.
"""

from __future__ import annotations

import pytest
import torch

from stagekit.parallel.launch import run_ranks

TOLERANCE = 1e-4

# (name, model overrides, text tokens); text_dim 32, in/out channels 16, patch (1, 2, 2), 2 layers.
CONFIGS: list[tuple[str, dict, int]] = [
    ("heads4-dim8-ffn64", {"num_attention_heads": 4, "attention_head_dim": 8, "ffn_dim": 64}, 7),
    ("heads8-dim12-ffn96", {"num_attention_heads": 8, "attention_head_dim": 12, "ffn_dim": 96}, 5),
    ("heads8-dim16-ffn160", {"num_attention_heads": 8, "attention_head_dim": 16, "ffn_dim": 160}, 9),
    # I2V layout: image-context add_k_proj / add_v_proj and norm_added_k; the last 512 tokens are the text.
    (
        "i2v-heads4-dim8-ffn64",
        {"num_attention_heads": 4, "attention_head_dim": 8, "ffn_dim": 64, "image_dim": 24, "added_kv_proj_dim": 32},
        512,
    ),
]

# diffusers' WanTransformer3DModel._keep_in_fp32_modules, as from_pretrained(torch_dtype=bf16) applies it.
KEEP_IN_FP32 = ("rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")


def _build(overrides: dict, dtype: torch.dtype = torch.float32):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    kwargs = {
        "patch_size": (1, 2, 2),
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 32,
        "freq_dim": 256,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 1024,
        **overrides,
    }
    model = WanTransformer3DModel(**kwargs).eval()
    with torch.no_grad():
        # Norm weights start at one, which would hide a wrongly sliced sharded norm.
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.copy_(1.0 + 0.3 * torch.randn_like(parameter))
    if dtype != torch.float32:
        for name, parameter in model.named_parameters():
            keep = any(part in KEEP_IN_FP32 for part in name.split("."))
            parameter.data = parameter.data.to(torch.float32 if keep else dtype)
    return model


def _inputs(overrides: dict, text_tokens: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 16, 2, 8, 8, generator=generator).to(dtype),
        "timestep": torch.tensor([637.0]),
        "encoder_hidden_states": torch.randn(1, text_tokens, 32, generator=generator).to(dtype),
    }
    if overrides.get("image_dim"):
        inputs["encoder_hidden_states_image"] = torch.randn(1, 6, overrides["image_dim"], generator=generator).to(dtype)
    return inputs


def _forward(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _tensor_parallel_case(overrides: dict, text_tokens: int, tp_mesh) -> dict:
    from stagekit.parallel.hsdp import local_parameter_bytes
    from stagekit.parallel.tensor_parallel import apply_tensor_parallel

    inputs = _inputs(overrides, text_tokens)
    reference = _forward(_build(overrides), inputs)
    model = _build(overrides)
    before = local_parameter_bytes(model)
    apply_tensor_parallel(model, tp_mesh)
    output = _forward(model, inputs)
    return {
        "diff": _max_diff(output, reference),
        "scale": reference.abs().max().item(),
        "bytes_before": before,
        "bytes_after": local_parameter_bytes(model),
    }


def _hsdp_case(overrides: dict, text_tokens: int, mesh, dtype: torch.dtype = torch.float32) -> dict:
    from stagekit.parallel.hsdp import apply_hsdp, local_parameter_bytes

    inputs = _inputs(overrides, text_tokens, dtype)
    reference = _forward(_build(overrides, dtype), inputs)
    model = _build(overrides, dtype)
    before = local_parameter_bytes(model)
    apply_hsdp(model, mesh)
    output = _forward(model, inputs)
    again = _forward(model, inputs)  # the second forward all-gathers from resharded parameters
    return {
        "diff": max(_max_diff(output, reference), _max_diff(again, reference)),
        "scale": reference.abs().max().item(),
        "bytes_before": before,
        "bytes_after": local_parameter_bytes(model),
    }


def _sharded_rms_norm_case(tp_mesh) -> dict:
    from stagekit.parallel.tensor_parallel import HeadShardedRMSNorm

    diffs = {}
    size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    for dtype, eps in ((torch.float32, 1e-6), (torch.bfloat16, 1e-6), (torch.float32, None)):
        torch.manual_seed(2)
        norm = torch.nn.RMSNorm(48, eps=eps)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(48))
        norm.to(dtype)
        x = torch.randn(2, 11, 48).to(dtype)
        full = norm(x)
        local = HeadShardedRMSNorm.from_rms_norm(norm, tp_mesh)(x.chunk(size, dim=-1)[rank])
        diffs[f"{dtype}-eps{eps}"] = _max_diff(local, full.chunk(size, dim=-1)[rank])
    return diffs


def _refusal_case(tp_mesh) -> str:
    from stagekit.parallel.tensor_parallel import apply_tensor_parallel

    model = _build({"num_attention_heads": 3, "attention_head_dim": 8, "ffn_dim": 64})
    try:
        apply_tensor_parallel(model, tp_mesh)
    except ValueError as error:
        unchanged = all(
            block.attn1.heads == 3 and isinstance(block.attn1.norm_q, torch.nn.RMSNorm) for block in model.blocks
        )
        return f"{error} | unchanged={unchanged}"
    return "accepted"


def _ranks_2(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from stagekit.parallel.mesh import ParallelConfig, build_hsdp_mesh, build_mesh

    tp_mesh = build_mesh(ParallelConfig(tp_degree=2), "cpu")["tp"]
    hsdp_mesh = build_hsdp_mesh(ParallelConfig(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=1), "cpu")
    shard_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    results: dict = {"rms_norm": _sharded_rms_norm_case(tp_mesh), "refusal": _refusal_case(tp_mesh)}
    for name, overrides, text_tokens in CONFIGS:
        results[f"tp2/{name}"] = _tensor_parallel_case(overrides, text_tokens, tp_mesh)
        results[f"hsdp(1x2)/{name}"] = _hsdp_case(overrides, text_tokens, hsdp_mesh)
    name, overrides, text_tokens = CONFIGS[1]
    results[f"fsdp(2)/{name}"] = _hsdp_case(overrides, text_tokens, shard_mesh)
    results[f"hsdp(1x2)-bf16-fp32-kept/{name}"] = _hsdp_case(overrides, text_tokens, hsdp_mesh, torch.bfloat16)
    return results


def _ranks_4(rank: int, world_size: int) -> dict:
    from stagekit.parallel.mesh import ParallelConfig, build_hsdp_mesh, build_mesh

    hsdp_mesh = build_hsdp_mesh(ParallelConfig(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2), "cpu")
    tp_mesh = build_mesh(ParallelConfig(tp_degree=4), "cpu")["tp"]
    results: dict = {}
    for name, overrides, text_tokens in CONFIGS[:3]:
        results[f"hsdp(2x2)/{name}"] = _hsdp_case(overrides, text_tokens, hsdp_mesh)
    name, overrides, text_tokens = CONFIGS[1]
    results[f"tp4/{name}"] = _tensor_parallel_case(overrides, text_tokens, tp_mesh)
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_ranks_2, 2)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_ranks_4, 4)


def _assert_cases(per_rank: list[dict], prefix: str) -> None:
    cases = sorted(key for key in per_rank[0] if key.startswith(prefix))
    assert cases, f"no case starts with {prefix}"
    for rank, results in enumerate(per_rank):
        for case in cases:
            result = results[case]
            assert result["scale"] > 0.1, f"{case}: reference output is nearly zero ({result['scale']:.3g})"
            assert result["diff"] <= TOLERANCE, (
                f"rank {rank} {case}: max abs difference {result['diff']:.3g} from the single-rank output "
                f"exceeds {TOLERANCE}"
            )
        print(f"rank {rank}", {case: results[case]["diff"] for case in cases})


def test_tensor_parallel_2_matches_single_rank(two_ranks: list[dict]) -> None:
    _assert_cases(two_ranks, "tp2/")
    for case in (key for key in two_ranks[0] if key.startswith("tp2/")):
        result = two_ranks[0][case]
        assert result["bytes_after"] < 0.8 * result["bytes_before"], f"{case}: {result}"


def test_tensor_parallel_4_matches_single_rank(four_ranks: list[dict]) -> None:
    _assert_cases(four_ranks, "tp4/")


def test_hsdp_shard_2_matches_single_rank_and_halves_parameters(two_ranks: list[dict]) -> None:
    _assert_cases(two_ranks, "hsdp(1x2)/")
    _assert_cases(two_ranks, "fsdp(2)/")
    for case in (key for key in two_ranks[0] if key.startswith(("hsdp(1x2)/", "fsdp(2)/"))):
        before = two_ranks[0][case]["bytes_before"]
        total = sum(results[case]["bytes_after"] for results in two_ranks)
        assert total == before, f"{case}: shards add up to {total} bytes, the model has {before}"
        assert max(results[case]["bytes_after"] for results in two_ranks) <= 0.55 * before, f"{case}"


def test_hsdp_keeps_mixed_dtypes_exact(two_ranks: list[dict]) -> None:
    """A bf16 model with diffusers' fp32-kept modules: the gathered weights are the originals, so equality is exact."""
    for results in two_ranks:
        (case,) = [key for key in results if key.startswith("hsdp(1x2)-bf16")]
        assert results[case]["diff"] == 0.0, f"{case}: max abs difference {results[case]['diff']:.3g}"


def test_hsdp_replicate_2_shard_2_matches_single_rank(four_ranks: list[dict]) -> None:
    _assert_cases(four_ranks, "hsdp(2x2)/")
    for case in (key for key in four_ranks[0] if key.startswith("hsdp(2x2)/")):
        before = four_ranks[0][case]["bytes_before"]
        per_rank = [results[case]["bytes_after"] for results in four_ranks]
        # Replicas hold the same shards: ranks (0, 1) and (2, 3) each add up to the whole model.
        assert per_rank[0] + per_rank[1] == before and per_rank[:2] == per_rank[2:], f"{case}: {per_rank}"


def test_head_sharded_rms_norm_equals_full_norm(two_ranks: list[dict]) -> None:
    for rank, results in enumerate(two_ranks):
        for case, diff in results["rms_norm"].items():
            limit = 0.0 if "bfloat16" in case else 1e-6
            assert diff <= limit, f"rank {rank} {case}: max abs difference {diff:.3g}"


def test_tensor_parallel_refuses_indivisible_heads(two_ranks: list[dict]) -> None:
    message = two_ranks[0]["refusal"]
    assert "--tensor-parallel-size 2 does not divide the model's 3 attention heads" in message, message
    assert "[1, 3]" in message and "unchanged=True" in message, message
