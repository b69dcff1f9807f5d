"""The memory guard at stage startup (services/memory_budget.py), at a small scale.

The estimate must equal what the loader really holds, and a stage whose weights do not fit must refuse to start
with one line naming the stage, the bytes needed and available, and a real flag that fixes it. The available
figure is faked through the environment variable the module documents.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from transformers import UMT5EncoderModel

from services.memory_budget import (
    AVAILABLE_ENV,
    RUNTIME_RESERVE_BYTES,
    MemoryBudgetError,
    WeightNeed,
    available_bytes,
    cgroup_headroom,
    check_weights_fit,
    checkpoint_components,
    stage_need,
)
from services.stage import parameter_bytes
from stagekit.weights import load_pretrained, planned_bytes


@pytest.mark.parametrize(
    ("component", "model_class"),
    [("transformer", WanTransformer3DModel), ("text_encoder", UMT5EncoderModel), ("vae", AutoencoderKLWan)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_is_the_loaded_parameter_bytes(tiny_model: Path, component, model_class, dtype) -> None:
    loaded = load_pretrained(model_class, tiny_model / component, dtype=dtype, num_threads=1)
    assert planned_bytes(model_class, tiny_model / component, dtype=dtype) == parameter_bytes(loaded)


def test_the_estimate_counts_what_the_class_keeps_in_fp32(tiny_model: Path) -> None:
    """Wan's norms and time embedder stay fp32 in a bf16 load: the bf16 estimate is more than half the fp32 one."""
    fp32 = planned_bytes(WanTransformer3DModel, tiny_model / "transformer", dtype=torch.float32)
    bf16 = planned_bytes(WanTransformer3DModel, tiny_model / "transformer", dtype=torch.bfloat16)
    assert fp32 // 2 < bf16 < fp32


def test_each_stage_counts_its_own_components(tiny_model: Path) -> None:
    assert set(checkpoint_components(tiny_model, library="transformers")) == {"text_encoder"}
    assert set(checkpoint_components(tiny_model, names=("transformer", "transformer_2"))) == {"transformer"}
    assert set(checkpoint_components(tiny_model, names=("vae",))) == {"vae"}


def test_a_need_that_does_not_fit_names_the_stage_the_sizes_and_the_fix(tiny_model: Path) -> None:
    components = checkpoint_components(tiny_model, names=("vae",))
    need = stage_need("vae", torch.device("cpu"), torch.float32, components, copies=2, fixes=["a smaller X"])
    weights = 2 * planned_bytes(AutoencoderKLWan, tiny_model / "vae", dtype=torch.float32)
    assert need.weight_bytes == weights
    assert need.total_bytes == weights + 2 * RUNTIME_RESERVE_BYTES
    assert need.fixes[0].startswith("--dtype bfloat16") and need.fixes[1] == "a smaller X"

    check_weights_fit(need, (need.total_bytes, "test"))  # exactly enough: fits
    with pytest.raises(MemoryBudgetError) as refused:
        check_weights_fit(need, (need.total_bytes - 1, "the test's figure"))
    message = str(refused.value)
    assert "\n" not in message
    for words in ("the vae stage", "on cpu as float32", "for 2 processes", "the test's figure", "--dtype bfloat16"):
        assert words in message, message


def test_without_a_fix_the_message_says_so() -> None:
    need = WeightNeed("dit", torch.device("cpu"), torch.bfloat16, {"transformer": 10**12})
    with pytest.raises(MemoryBudgetError, match="none of this stage's flags makes them fit"):
        check_weights_fit(need, (10**9, "test"))


def test_the_environment_replaces_the_measured_figure(monkeypatch) -> None:
    monkeypatch.setenv(AVAILABLE_ENV, "12345")
    assert available_bytes(torch.device("cpu")) == (12345, f"${AVAILABLE_ENV}")
    monkeypatch.setenv(AVAILABLE_ENV, "lots")
    with pytest.raises(MemoryBudgetError, match=AVAILABLE_ENV):
        available_bytes(torch.device("cpu"))
    monkeypatch.delenv(AVAILABLE_ENV)
    measured, source = available_bytes(torch.device("cpu"))
    assert measured > 0 and source


def test_the_cgroup_limit_lowers_what_is_available(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "outer" / "stage").mkdir(parents=True)
    for path, limit, current in [(root / "outer", "5000", "1000"), (root / "outer" / "stage", "max", "700")]:
        (path / "memory.max").write_text(limit + "\n")
        (path / "memory.current").write_text(current + "\n")
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text("0::/outer/stage\n")
    assert cgroup_headroom(root, self_cgroup) == 4000  # the parent's limit less its usage
    (root / "outer" / "stage" / "memory.max").write_text("1500\n")
    assert cgroup_headroom(root, self_cgroup) == 800
    self_cgroup.write_text("1:name=systemd:/\n")  # cgroup v1 only
    assert cgroup_headroom(root, self_cgroup) is None
