"""A rank that holds only a shard of the DiT (tensor parallel, HSDP) reads only that shard, and gets it exactly.

Two gloo ranks load the tiny Wan transformer with `load_pretrained(shard_model=...)`; every sharded
parameter, gathered back, must equal `from_pretrained`'s, and each rank must have read from the files
exactly the bytes of what it holds, well under the whole checkpoint.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from diffusers import WanTransformer3DModel
from torch.distributed.tensor import DTensor

from families.init_model import init_model
from families.wan.parallel import parallelize
from stagekit.parallel import ParallelConfig, build_mesh
from stagekit.parallel.launch import run_ranks
from stagekit.weights import load_pretrained, load_stats

LAYOUTS = {
    "tp2": ParallelConfig(tp_degree=2),
    "hsdp2": ParallelConfig(use_hsdp=True, hsdp_shard_size=2),
}


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Wan checkpoint in many small safetensors shards."""
    return str(init_model("wan-t2v", "tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0, shard_size=50_000))


def _load_on_rank(rank: int, world_size: int, model_dir: str, layout: str, dtype: torch.dtype) -> dict:
    """Loads this rank's shards and compares each, gathered, with `from_pretrained` here (tensors stay in the rank)."""
    config = LAYOUTS[layout]
    device = torch.device("cpu")
    mesh = build_mesh(config, "cpu")
    shard = partial(parallelize, config=config, mesh=mesh, device=device)
    model = load_pretrained(
        WanTransformer3DModel, f"{model_dir}/transformer", dtype=dtype, num_threads=2, shard_model=shard
    )
    expected = WanTransformer3DModel.from_pretrained(f"{model_dir}/transformer", torch_dtype=dtype).state_dict()
    held_elements = 0
    sharded_keys = []
    mismatched = []
    state = model.state_dict()
    for key, value in state.items():
        if isinstance(value, DTensor):
            sharded_keys.append(key)
            held_elements += value.to_local().numel()
            value = value.full_tensor()
        else:
            held_elements += value.numel()
        if value.dtype != expected[key].dtype or not torch.equal(value, expected[key]):
            mismatched.append(key)
    return {
        "read_bytes": load_stats(model).total_bytes,
        "held_elements": held_elements,
        # init-model writes fp32 files: 4 bytes an element, whatever dtype the model is loaded in.
        "checkpoint_bytes": 4 * sum(t.numel() for t in expected.values()),
        "keys_differ": sorted(set(state) ^ set(expected)),
        "mismatched": mismatched,
        "sharded_keys": len(sharded_keys),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_rank_reads_only_its_shards_and_they_are_exact(sharded_checkpoint: str, layout: str, dtype) -> None:
    per_rank = run_ranks(_load_on_rank, 2, sharded_checkpoint, layout, dtype)
    for rank, result in enumerate(per_rank):
        assert result["keys_differ"] == []
        assert result["mismatched"] == []
        assert result["sharded_keys"] > 0, "the layout sharded nothing"
        total = result["checkpoint_bytes"]
        read = result["read_bytes"]
        print(f"{layout} {dtype} rank {rank}: read {read} of {total} bytes ({read / total:.2f})")
        assert read == 4 * result["held_elements"]
        # HSDP shards everything (half each); TP leaves embeddings, norms and modulation whole (about 0.74 here).
        assert read < (0.55 if layout.startswith("hsdp") else 0.8) * total


def test_shard_model_and_tensor_filter_cannot_be_combined(sharded_checkpoint: str) -> None:
    with pytest.raises(ValueError, match="shard_model and tensor_filter"):
        load_pretrained(
            WanTransformer3DModel,
            f"{sharded_checkpoint}/transformer",
            shard_model=lambda model: None,
            tensor_filter=lambda key: True,
        )
