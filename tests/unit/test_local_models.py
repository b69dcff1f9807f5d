"""`stagediff up` with several models: a DiT each, one text encoder and one VAE per pool of models whose files for
them are the same, and the orchestrator given every one. No process is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from families.registry import FAMILIES
from stagediff.local import up
from stagediff.local.supervisor import LocalCluster
from tests.helpers.checkpoint_files import fake_checkpoint

PORTS = {"text-encoder": 50061, "dit": 50062, "vae": 50063, "interp": 50064}


def _models(root: Path) -> list[Path]:
    """Wan text-to-video and Wan2.2 image-to-video sharing the text encoder and the VAE, and Qwen-Image."""
    return [
        fake_checkpoint(root / "t2v", FAMILIES["wan-t2v"]),
        fake_checkpoint(root / "i2v", FAMILIES["wan2.2-i2v-a14b"]),
        fake_checkpoint(root / "qwen", FAMILIES["qwen-image"], text=b"qwen2.5-vl", vae=b"qwen vae"),
    ]


def test_shared_components_run_once_and_each_model_has_its_dit(tmp_path: Path) -> None:
    t2v, i2v, qwen = _models(tmp_path)
    cluster = LocalCluster([t2v, i2v, qwen], extra_args={"dit": ["--threads", "1"]})
    stages = {name: service for name, service in cluster.compose.items() if service.stage_kind is not None}
    assert sorted(stages) == [
        "dit.i2v", "dit.qwen", "dit.t2v", "interp", "text-encoder.qwen", "text-encoder.t2v", "vae.i2v", "vae.qwen"
    ]  # fmt: skip

    def serves(name: str) -> list[str]:
        command = stages[name].command
        return [command[index + 1] for index, arg in enumerate(command) if arg in ("--model", "--also-serve")]

    # One UMT5 for both Wan models; the VAE loaded from the image-to-video checkpoint, whose family also encodes.
    assert serves("text-encoder.t2v") == ["/models/t2v", "/models/i2v"]
    assert serves("vae.i2v") == ["/models/i2v", "/models/t2v"]
    assert serves("text-encoder.qwen") == serves("vae.qwen") == serves("dit.qwen") == ["/models/qwen"]
    assert serves("dit.t2v") == ["/models/t2v"] and serves("dit.i2v") == ["/models/i2v"]
    assert sorted(stages["vae.i2v"].volumes) == [(str(i2v), "/models/i2v"), (str(t2v), "/models/t2v")]
    # The orchestrator is given every service of each stage, and waits for them all.
    orchestrator = cluster.compose["orchestrator"]
    flags = dict(zip(orchestrator.command[2::2], orchestrator.command[3::2], strict=False))
    assert flags["--text-encoder"] == "text-encoder.t2v:50061,text-encoder.qwen:50061"
    assert flags["--dit"] == "dit.t2v:50062,dit.i2v:50062,dit.qwen:50062"
    assert flags["--vae"] == "vae.i2v:50063,vae.qwen:50063"
    assert flags["--interp"] == "interp:50064"
    assert set(orchestrator.depends_on) == {name for name in stages if name != "interp"}
    # Local commands: each model's directory where its stages read it; a stage's options reach every model's service.
    plans = cluster.plan()
    args = plans["text-encoder.t2v"].args
    assert (args[args.index("--model") + 1], args[args.index("--also-serve") + 1]) == (str(t2v), str(i2v))
    assert all(plans[name].args[-2:] == ["--threads", "1"] for name in ("dit.t2v", "dit.i2v", "dit.qwen"))


def test_models_that_share_nothing_run_everything_and_one_model_changes_nothing(tmp_path: Path) -> None:
    t2v = fake_checkpoint(tmp_path / "t2v", FAMILIES["wan-t2v"])
    other = fake_checkpoint(tmp_path / "other", FAMILIES["wan-t2v"], text=b"another umt5", vae=b"another vae")
    stages = sorted(name for name, service in LocalCluster([t2v, other]).compose.items() if service.stage_kind)
    assert stages == [
        "dit.other", "dit.t2v", "interp", "text-encoder.other", "text-encoder.t2v", "vae.other", "vae.t2v"
    ]  # fmt: skip
    assert sorted(name for name, service in LocalCluster(t2v).compose.items() if service.stage_kind) == [
        "dit", "interp", "text-encoder", "vae"
    ]  # fmt: skip


def test_several_models_are_refused_where_they_cannot_be_told_apart_or_replicated(tmp_path: Path) -> None:
    first = fake_checkpoint(tmp_path / "a" / "wan", FAMILIES["wan-t2v"])
    second = fake_checkpoint(tmp_path / "b" / "wan", FAMILIES["wan-t2v"])
    with pytest.raises(ValueError, match="several directories are named wan; a model's id is its directory's name"):
        LocalCluster([first, second])
    other = fake_checkpoint(tmp_path / "other", FAMILIES["wan-t2v"])
    with pytest.raises(ValueError, match="--replicas: with several --model"):
        LocalCluster([first, other], replicas={"dit": 2})


def test_up_takes_model_more_than_once() -> None:
    args = up.build_parser().parse_args(["--model", "a", "--model", "b"])
    assert args.model == ["a", "b"]
