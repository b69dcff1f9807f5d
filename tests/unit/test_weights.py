"""`stagekit.weights.load_pretrained` gives exactly what `from_pretrained` gives, for every component.

The checkpoint is the tiny Wan one written with a small shard size, so each component is spread over
several safetensors shards and the threaded reader really splits work between files.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from safetensors.torch import load_file, save_file
from transformers import UMT5EncoderModel

from families.init_model import init_model
from stagekit.weights import load_pretrained, load_stats

COMPONENTS = {
    "transformer": WanTransformer3DModel,
    "vae": AutoencoderKLWan,
    "text_encoder": UMT5EncoderModel,
}


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("wan-t2v", "tiny", tmp_path_factory.mktemp("models") / "tiny-sharded", seed=0, shard_size=20_000)


def _reference(cls: type, directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    """`from_pretrained`. Uncast weights are views of the mapped files there and in ours, at the same
    byte alignment, so even CPU kernels whose results depend on alignment give identical outputs."""
    kwargs = {"dtype": dtype} if cls is UMT5EncoderModel else {"torch_dtype": dtype}
    return cls.from_pretrained(directory, **kwargs)


def _forward(name: str, model: torch.nn.Module) -> torch.Tensor:
    """One deterministic forward pass of a component, in the model's own dtype."""
    g = torch.Generator().manual_seed(0)
    dtype = model.dtype  # both libraries skip modules kept in fp32 here
    with torch.no_grad():
        if name == "transformer":
            hidden = torch.randn(1, 16, 2, 8, 8, generator=g).to(dtype)
            text = torch.randn(1, 7, 32, generator=g).to(dtype)
            return model(hidden, torch.tensor([500]), text, return_dict=False)[0]
        if name == "vae":
            latents = torch.randn(1, 16, 2, 4, 4, generator=g).to(dtype)
            return model.decode(latents).sample
        ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 6:] = 0
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


def _assert_same_tensors(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    for kind in ("named_parameters", "named_buffers"):
        mine = dict(getattr(ours, kind)(remove_duplicate=False))
        theirs = dict(getattr(ref, kind)(remove_duplicate=False))
        assert mine.keys() == theirs.keys(), f"{kind}: {sorted(mine.keys() ^ theirs.keys())}"
        for key, value in theirs.items():
            assert mine[key].dtype == value.dtype, f"{key}: {mine[key].dtype} != {value.dtype}"
            assert mine[key].device == value.device, key
            assert torch.equal(mine[key], value), key


@pytest.mark.parametrize("num_threads", [1, 4])
@pytest.mark.parametrize("name", list(COMPONENTS))
def test_matches_from_pretrained(sharded_model: Path, name: str, num_threads: int) -> None:
    directory = sharded_model / name
    assert len(list(directory.glob("*.safetensors"))) >= 3, "the checkpoint should be sharded"
    cls = COMPONENTS[name]
    ref = _reference(cls, directory, torch.float32)
    ours = load_pretrained(cls, directory, device="cpu", dtype=torch.float32, num_threads=num_threads)

    assert type(ours) is cls and not ours.training
    _assert_same_tensors(ours, ref)
    assert torch.equal(_forward(name, ours), _forward(name, ref))

    stats = load_stats(ours)
    assert stats.threads == num_threads
    assert stats.total_bytes == sum(t.numel() * t.element_size() for t in load_file_all(directory).values())
    assert len(stats.shards) == len(list(directory.glob("*.safetensors")))


def load_file_all(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("name", list(COMPONENTS))
def test_bf16_matches_from_pretrained(sharded_model: Path, name: str) -> None:
    directory = sharded_model / name
    cls = COMPONENTS[name]
    ref = _reference(cls, directory, torch.bfloat16)
    ours = load_pretrained(cls, directory, dtype=torch.bfloat16, num_threads=4)
    _assert_same_tensors(ours, ref)
    assert torch.equal(_forward(name, ours), _forward(name, ref))


def test_keep_in_fp32_modules_stay_fp32(sharded_model: Path) -> None:
    directory = sharded_model / "transformer"
    keep = set(WanTransformer3DModel._keep_in_fp32_modules)
    model = load_pretrained(WanTransformer3DModel, directory, dtype=torch.bfloat16)
    kept = {k for k, p in model.named_parameters() if keep.intersection(k.split("."))}
    assert kept, "the tiny transformer should have modules kept in fp32"
    for key, param in model.named_parameters():
        assert param.dtype == (torch.float32 if key in kept else torch.bfloat16), key

    everything_bf16 = load_pretrained(WanTransformer3DModel, directory, dtype=torch.bfloat16, keep_in_fp32=[])
    assert {p.dtype for p in everything_bf16.parameters()} == {torch.bfloat16}


def test_writing_a_weight_leaves_the_file_unchanged(sharded_model: Path) -> None:
    directory = sharded_model / "transformer"
    before = load_file_all(directory)
    model = load_pretrained(WanTransformer3DModel, directory)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    assert all(torch.equal(before[k], v) for k, v in load_file_all(directory).items())
    assert torch.equal(model.proj_out.bias, before["proj_out.bias"] + 1.0)


def test_tied_embeddings_are_shared(sharded_model: Path) -> None:
    model = load_pretrained(UMT5EncoderModel, sharded_model / "text_encoder", num_threads=2)
    assert model.encoder.embed_tokens.weight is model.shared.weight


def _single_file_copy(src: Path, dst: Path, edit) -> Path:
    """`src` rewritten as one safetensors file after `edit(state_dict)`."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    state = load_file_all(src)
    edit(state)
    save_file(state, dst / "diffusion_pytorch_model.safetensors")
    return dst


def test_missing_key_is_named(sharded_model: Path, tmp_path: Path) -> None:
    directory = _single_file_copy(
        sharded_model / "transformer", tmp_path / "missing", lambda s: s.pop("blocks.1.ffn.net.2.weight")
    )
    with pytest.raises(ValueError, match=r"missing keys \(1\): blocks\.1\.ffn\.net\.2\.weight"):
        load_pretrained(WanTransformer3DModel, directory)


def test_unexpected_key_is_named(sharded_model: Path, tmp_path: Path) -> None:
    def add(state: dict[str, torch.Tensor]) -> None:
        state["blocks.9.extra.weight"] = torch.zeros(3)

    directory = _single_file_copy(sharded_model / "transformer", tmp_path / "unexpected", add)
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): blocks\.9\.extra\.weight"):
        load_pretrained(WanTransformer3DModel, directory)


def test_shape_mismatch_is_named(sharded_model: Path, tmp_path: Path) -> None:
    def shrink(state: dict[str, torch.Tensor]) -> None:
        state["proj_out.bias"] = state["proj_out.bias"][:-1].clone()

    directory = _single_file_copy(sharded_model / "transformer", tmp_path / "shape", shrink)
    with pytest.raises(ValueError, match=r"shape mismatches \(1\): proj_out\.bias"):
        load_pretrained(WanTransformer3DModel, directory)


def test_tensor_filter_reads_only_selected_keys(sharded_model: Path) -> None:
    directory = sharded_model / "transformer"
    full = load_pretrained(WanTransformer3DModel, directory)
    part = load_pretrained(WanTransformer3DModel, directory, tensor_filter=lambda key: not key.startswith("blocks.1."))
    for key, param in part.named_parameters():
        if key.startswith("blocks.1."):
            assert param.is_meta, key
        else:
            assert torch.equal(param, full.get_parameter(key)), key
    assert 0 < load_stats(part).total_bytes < load_stats(full).total_bytes


def test_tensor_filter_with_a_transformers_model(sharded_model: Path) -> None:
    directory = sharded_model / "text_encoder"
    full = load_pretrained(UMT5EncoderModel, directory)
    part = load_pretrained(UMT5EncoderModel, directory, tensor_filter=lambda key: ".block.1." not in key)
    for key, param in part.named_parameters():
        assert param.is_meta == (".block.1." in key), key
        if not param.is_meta:
            assert torch.equal(param, full.get_parameter(key)), key
    assert part.encoder.embed_tokens.weight is part.shared.weight


def test_logs_each_shard(sharded_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = sharded_model / "vae"
    with caplog.at_level(logging.INFO, logger="stagekit.weights"):
        load_pretrained(AutoencoderKLWan, directory, num_threads=3)
    index = json.loads((directory / "diffusion_pytorch_model.safetensors.index.json").read_text())
    logged = " ".join(r.getMessage() for r in caplog.records)
    for shard in set(index["weight_map"].values()):
        assert f"read {shard}: " in logged


def test_rejects_other_classes(sharded_model: Path) -> None:
    with pytest.raises(TypeError, match="Linear"):
        load_pretrained(torch.nn.Linear, sharded_model / "transformer")
