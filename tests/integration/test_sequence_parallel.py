"""Sequence parallelism (Ulysses, Ring, USP) equals single-rank attention and a single-rank Wan forward.

Each spawned run checks several configurations at once (starting a rank costs seconds of imports);
ranks return the measured max abs differences and the test asserts on them here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stagekit.parallel.attention import (
    _attention_with_lse_math,
    _merge_block,
    attention_with_lse,
    ring_attention,
    ulysses_attention,
    usp_attention,
)
from stagekit.parallel.launch import run_ranks

TOLERANCE = 1e-4

# (name, ulysses degree, ring degree) for each world size.
MESHES = {
    2: [("ulysses2", 2, 1), ("ring2", 1, 2)],
    4: [("ulysses4", 4, 1), ("ring4", 1, 4), ("usp2x2", 2, 2)],
}

# Small random Wan transformers; latents (B, C, F, H, W) with patch (1, 2, 2) give F * H/2 * W/2 tokens.
# 15 and 5 tokens are divisible by neither 2 nor 4; with 5 tokens over 4 ranks the last shard is all padding.
TRANSFORMER_CASES = [
    {"name": "heads4_dim12_15tokens", "heads": 4, "head_dim": 12, "latent": (1, 4, 1, 6, 10), "token_timestep": False},
    {"name": "heads8_dim8_8tokens", "heads": 8, "head_dim": 8, "latent": (1, 4, 2, 4, 4), "token_timestep": False},
    {"name": "heads8_dim16_15tokens", "heads": 8, "head_dim": 16, "latent": (1, 4, 3, 2, 10), "token_timestep": False},
    # Batch 2 and a per-token timestep [B, S] (Wan2.2 TI2V), which the plan splits at the model's input.
    {
        "name": "heads4_dim16_5tokens_b2_tokentime",
        "heads": 4,
        "head_dim": 16,
        "latent": (2, 4, 5, 2, 2),
        "token_timestep": True,
    },
]


def _reference_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in fp64 on [B, S, H, D]; returns out and lse [B, S, H]."""
    scores = torch.einsum("bqhd,bkhd->bhqk", query.double(), key.double()) * query.shape[-1] ** -0.5
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), value.double())
    return out.float(), torch.logsumexp(scores, dim=-1).transpose(1, 2).float()


def _padding_mask(batch_size: int, seq_len: int, local_len: int, generator: torch.Generator) -> torch.Tensor:
    """Row 0: the last shard and one more key are padding; row 1: random padding, first shard all real."""
    mask = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    mask[0, seq_len - local_len - 1 :] = True
    mask[1, local_len:] = torch.rand(seq_len - local_len, generator=generator) < 0.4
    return mask


# Single-process tests of the building blocks.


def test_attention_with_lse_matches_reference_and_handles_rows_without_keys() -> None:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 5, 4, 8, generator=generator)
    key = torch.randn(3, 7, 4, 8, generator=generator)
    value = torch.randn(3, 7, 4, 8, generator=generator)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 2:] = True
    mask[2] = True  # no real key at all

    expected_out, expected_lse = _reference_attention(query[:2], key[:2], value[:2], mask[:2])
    # The CPU kernel (through the public function) and the fp32 fallback, on the rows that have keys.
    for kernel in (attention_with_lse, _attention_with_lse_math):
        out, lse = kernel(query, key, value, mask)
        assert (out[:2] - expected_out).abs().max() <= 1e-5
        assert (lse[:2] - expected_lse).abs().max() <= 1e-5
    out, lse = attention_with_lse(query, key, value, mask)
    assert lse.shape == (3, 5, 4) and lse.dtype == torch.float32
    assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))
    assert not torch.isnan(out).any()


def test_merge_of_blocks_is_exact_including_blocks_of_padding_only() -> None:
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, 4, 2, 8, generator=generator)
    key = torch.randn(2, 12, 2, 8, generator=generator)
    value = torch.randn(2, 12, 2, 8, generator=generator)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, :4] = True  # the first block of row 0 is all padding: merging starts from lse = -inf
    mask[:, 8:] = True  # the last block is padding in every row
    out, lse = None, None
    for start in (0, 4, 8):
        block = slice(start, start + 4)
        block_out, block_lse = attention_with_lse(query, key[:, block], value[:, block], mask[:, block])
        out, lse = _merge_block(out, lse, block_out, block_lse)
    expected_out, expected_lse = _reference_attention(query, key, value, mask)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out - expected_out).abs().max() <= 1e-5
    assert (lse - expected_lse).abs().max() <= 1e-5


def test_without_groups_every_variant_is_plain_attention() -> None:
    generator = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(1, 6, 4, 8, generator=generator) for _ in range(3))
    expected, _ = _reference_attention(query, key, value, None)
    for out in (
        ulysses_attention(query, key, value, None),
        ring_attention(query, key, value, None),
        usp_attention(query, key, value, None, None),
    ):
        assert (out - expected).abs().max() <= 1e-5


# Spawned ranks.


def _attention_worker(rank: int, world_size: int, meshes: list[tuple[str, int, int]]) -> dict[str, float]:
    from stagekit.parallel.mesh import ParallelConfig, build_mesh

    diffs: dict[str, float] = {}
    for mesh_name, ulysses_degree, ring_degree in meshes:
        mesh = build_mesh(ParallelConfig(ulysses_degree=ulysses_degree, ring_degree=ring_degree), "cpu")
        ulysses_group = mesh["ulysses"].get_group()
        ring_group = mesh["ring"].get_group()
        shard = dist.get_rank(ring_group) * ulysses_degree + dist.get_rank(ulysses_group)
        for heads in (4, 8):
            for head_dim in (8, 16):
                for masked in (False, True):
                    generator = torch.Generator().manual_seed(heads * 100 + head_dim)
                    local_len = 3
                    seq_len = local_len * world_size
                    query, key, value = (torch.randn(2, seq_len, heads, head_dim, generator=generator) for _ in "qkv")
                    mask = _padding_mask(2, seq_len, local_len, generator) if masked else None
                    expected, _ = _reference_attention(query, key, value, mask)

                    local = slice(shard * local_len, (shard + 1) * local_len)
                    q, k, v = query[:, local], key[:, local], value[:, local]
                    m = mask[:, local] if masked else None
                    outputs = {"usp": usp_attention(q, k, v, ulysses_group, ring_group, m)}
                    if ring_degree == 1:
                        outputs["ulysses"] = ulysses_attention(q, k, v, ulysses_group, m)
                    if ulysses_degree == 1:
                        outputs["ring"] = ring_attention(q, k, v, ring_group, m)
                    for function, out in outputs.items():
                        name = f"{mesh_name}/{function}/heads{heads}/dim{head_dim}/{'masked' if masked else 'full'}"
                        diffs[name] = (out - expected[:, local]).abs().max().item()
    return diffs


def _transformer_worker(
    rank: int, world_size: int, meshes: list[tuple[str, int, int]], cases: list[dict]
) -> dict[str, float]:
    from diffusers import WanTransformer3DModel

    from families.wan.parallel import apply_sequence_parallel, remove_sequence_parallel
    from stagekit.parallel.mesh import ParallelConfig, build_mesh

    built = [
        (name, build_mesh(ParallelConfig(ulysses_degree=ulysses, ring_degree=ring), "cpu"))
        for name, ulysses, ring in meshes
    ]
    diffs: dict[str, float] = {}
    for case in cases:
        torch.manual_seed(0)
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=case["heads"],
            attention_head_dim=case["head_dim"],
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=32,
        ).eval()
        batch_size, _, frames, height, width = case["latent"]
        hidden_states = torch.randn(case["latent"])
        encoder_hidden_states = torch.randn(batch_size, 7, 16)
        if case["token_timestep"]:
            seq_len = frames * (height // 2) * (width // 2)
            timestep = torch.randint(0, 1000, (batch_size, seq_len)).float()
        else:
            timestep = torch.tensor([500.0] * batch_size)
        inputs = {"hidden_states": hidden_states, "timestep": timestep, "encoder_hidden_states": encoder_hidden_states}

        with torch.no_grad():
            expected = model(**inputs).sample
            for mesh_name, mesh in built:
                apply_sequence_parallel(model, mesh)
                out = model(**inputs).sample
                remove_sequence_parallel(model)
                diffs[f"{mesh_name}/{case['name']}"] = (out - expected).abs().max().item()
            diffs[f"removed/{case['name']}"] = (model(**inputs).sample - expected).abs().max().item()
    return diffs


def _assert_within_tolerance(results: list[dict[str, float]], tolerance: float) -> None:
    worst = {name: max(diffs[name] for diffs in results) for name in results[0]}
    print("\n".join(f"{name}: max abs diff {diff:.3e}" for name, diff in worst.items()))
    failed = {name: diff for name, diff in worst.items() if not diff <= tolerance}
    listed = ", ".join(f"{name} {diff:.3e}" for name, diff in failed.items())
    assert not failed, f"max abs differences over {tolerance}: {listed}"


def _worker(rank: int, world_size: int, meshes: list[tuple[str, int, int]], cases: list[dict]) -> dict[str, dict]:
    return {
        "attention": _attention_worker(rank, world_size, meshes),
        "transformer": _transformer_worker(rank, world_size, meshes, cases),
    }


_SPAWNED: dict[int, list[dict[str, dict]]] = {}


def _spawned(world_size: int, part: str) -> list[dict[str, float]]:
    """Each rank's differences of `part`: both parts are measured in one spawn per world size."""
    if world_size not in _SPAWNED:
        _SPAWNED[world_size] = run_ranks(_worker, world_size, MESHES[world_size], TRANSFORMER_CASES)
    return [diffs[part] for diffs in _SPAWNED[world_size]]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_ring_usp_attention_match_full_attention(world_size: int) -> None:
    _assert_within_tolerance(_spawned(world_size, "attention"), 1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_wan_transformer_matches_single_rank(world_size: int) -> None:
    results = _spawned(world_size, "transformer")
    # Removing the hooks gives back the single-rank model exactly.
    for diffs in results:
        assert all(diffs[f"removed/{case['name']}"] == 0.0 for case in TRANSFORMER_CASES)
    _assert_within_tolerance(results, TOLERANCE)
