"""`--model` as a local directory or a Hugging Face Hub id (services/model_source.py): which is which, the files
each stage fetches, resolution from an offline Hub cache laid out as the library lays it out, and one-line errors
saying what to run."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.utils import filter_repo_objects

from families.init_model import init_model
from services.checkpoint import read_checkpoint
from services.model_source import (
    CONFIG_PATTERNS,
    HubId,
    ModelSourceError,
    model_id_of,
    parse_hub_id,
    resolve_configs,
    resolve_model,
    stage_model,
    stage_patterns,
)
from stagediff.local.models import local_models
from tests.helpers.hub_cache import COMMIT, cache_checkpoint

REPO = "Wan-AI/Wan-tiny-Diffusers"
ALL_STAGES = ("text-encoder", "dit", "vae", "interp")


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache, with the Hub unreachable (HF_HUB_OFFLINE), as the library reads them."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The library reads its environment once, at import: its constants are what it goes by.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def cached_model(tiny_model: Path, offline_cache: Path) -> Path:
    return cache_checkpoint(tiny_model, offline_cache, REPO, refs=("main", "v1"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", HubId("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")),
        ("Qwen/Qwen-Image@main", HubId("Qwen/Qwen-Image", "main")),
        ("org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
        (f"org/name@{COMMIT}", HubId("org/name", COMMIT)),
        ("models/nope", HubId("models/nope")),
        ("./models/nope", None),
        ("/models/nope", None),
        ("~/nope", None),
        ("a/b/c", None),
        ("nope", None),
        ("org/..", None),
        ("-org/name", None),
        ("org/name.", None),
        ("org/na me", None),
        ("org/name@", None),
    ],
)
def test_a_hub_id_is_org_slash_name_with_an_optional_revision_and_anything_else_is_a_path(
    text: str, expected: HubId | None
) -> None:
    assert parse_hub_id(text) == expected


def test_an_existing_directory_wins_over_a_hub_id_of_the_same_spelling(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline_cache: Path
) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_model)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("models/tiny", ALL_STAGES) == tiny_model.resolve()


def test_a_missing_directory_says_so_in_one_line_with_the_init_model_command(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "nope"
    with pytest.raises(ModelSourceError) as raised:
        resolve_model(str(missing), ALL_STAGES)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"--model {missing}: no such directory")
    assert f"stagediff init-model --family wan-t2v --preset tiny --out {missing}" in message
    assert "ORG/NAME[@REVISION]" in message


def test_a_directory_without_model_index_json_says_it_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    with pytest.raises(ModelSourceError) as raised:
        resolve_model(str(tmp_path / "weights"), ALL_STAGES)
    message = str(raised.value)
    assert "\n" not in message
    assert "has no model_index.json, so it is not a diffusers checkpoint" in message
    assert "stagediff init-model" in message


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="a file, not a directory"):
        resolve_model(str(tmp_path / "model.safetensors"), ALL_STAGES)


@pytest.mark.parametrize("revision", ["", "@main", "@v1", f"@{COMMIT}"])
def test_a_hub_id_resolves_to_its_snapshot_in_the_offline_cache(cached_model: Path, revision: str) -> None:
    assert resolve_model(REPO + revision, ("dit",)) == cached_model


def test_an_unknown_hub_id_offline_says_so_in_one_line(offline_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as raised:
        resolve_model("models/nope", ALL_STAGES)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("--model models/nope: no such directory, and the Hugging Face Hub model is not in")
    assert str(offline_cache) in message
    assert "hf download models/nope" in message
    assert "stagediff init-model --family wan-t2v --preset tiny --out models/nope" in message


def test_an_unknown_revision_of_a_cached_model_is_not_found(cached_model: Path) -> None:
    with pytest.raises(ModelSourceError, match=f"--model {REPO}@v2: no such directory"):
        resolve_model(f"{REPO}@v2", ALL_STAGES)


def test_a_hub_snapshot_serves_under_its_repository_name(cached_model: Path) -> None:
    assert model_id_of(cached_model) == "Wan-tiny-Diffusers"
    assert read_checkpoint(cached_model).model_id == "Wan-tiny-Diffusers"
    (model,) = local_models([cached_model])
    assert model.model_id == "Wan-tiny-Diffusers"
    assert model_id_of(Path("/data/tiny")) == "tiny"


def _fetched(checkpoint: Path, stages: tuple[str, ...]) -> set[str]:
    """The files of `checkpoint` that snapshot_download fetches for `stages` (the library's own filter)."""
    files = [path.relative_to(checkpoint).as_posix() for path in checkpoint.rglob("*") if path.is_file()]
    patterns = stage_patterns(json.loads((checkpoint / "model_index.json").read_text()), stages)
    return set(filter_repo_objects(items=files, allow_patterns=patterns))


def test_each_stage_fetches_the_configs_and_only_the_components_it_holds(tiny_model: Path) -> None:
    folders = {name: {path.split("/")[0] for path in _fetched(tiny_model, (name,))} for name in ALL_STAGES}
    configs = {"model_index.json", "stagediff.json", "scheduler", "transformer", "vae"}
    assert folders["text-encoder"] == configs | {"text_encoder", "tokenizer"}
    assert folders["vae"] == configs
    assert folders["interp"] == configs
    # The DiT reports the whole checkpoint's component identities: it fetches every component.
    assert folders["dit"] == configs | {"text_encoder", "tokenizer"}
    text_encoder_files = _fetched(tiny_model, ("text-encoder",))
    assert not any(path.endswith(".safetensors") for path in text_encoder_files if path.startswith(("vae/", "tr")))
    assert "vae/diffusion_pytorch_model.safetensors" in _fetched(tiny_model, ("vae",))


def test_stagediff_up_with_a_missing_model_directory_exits_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stagediff.local.up import main as up

    missing = tmp_path / "models" / "nope"
    assert up(["--model", str(missing), "--state-dir", str(tmp_path / "state"), "--port", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"stagediff up: --model {missing}: no such directory; write a local demo checkpoint with "
        f"`stagediff init-model --family wan-t2v --preset tiny --out {missing}`, or give a Hugging Face Hub id "
        "ORG/NAME[@REVISION]"
    ]


def test_serve_resolves_its_model_for_its_stage_and_exits_with_one_line(cached_model: Path, tmp_path: Path) -> None:
    assert stage_model("vae", f"{REPO}@v1") == str(cached_model)
    assert stage_model("interp", None) is None
    with pytest.raises(SystemExit) as raised:
        stage_model("dit", "Wan-AI/nope")
    assert str(raised.value).startswith("stagediff serve dit: --model Wan-AI/nope: no such directory, and the Hugging")
    assert "\n" not in str(raised.value)
    with pytest.raises(SystemExit, match="^stagediff serve vae: --also-serve .*no model_index.json"):
        stage_model("vae", str(tmp_path), "--also-serve")


def test_a_config_preset_takes_its_configs_from_a_hub_id_fetching_no_weights(
    cached_model: Path, tiny_model: Path, tmp_path: Path
) -> None:
    source = resolve_configs(f"{REPO}@v1")
    assert source == cached_model
    out = init_model("wan-t2v", "wan2.1-1.3b-config", tmp_path / "out", config_from=source)
    for component in ("transformer", "vae"):
        written = json.loads((out / component / "config.json").read_text())
        tiny = json.loads((tiny_model / component / "config.json").read_text())
        assert {key: written[key] for key in tiny if not key.startswith("_")} == {
            key: value for key, value in tiny.items() if not key.startswith("_")
        }, component
    assert (
        json.loads((out / "text_encoder" / "config.json").read_text())["d_model"]
        == json.loads((tiny_model / "text_encoder" / "config.json").read_text())["d_model"]
    )
    with pytest.raises(ValueError, match="only a config preset takes the configs of another checkpoint; wan-t2v's: "):
        init_model("wan-t2v", "tiny", tmp_path / "other", config_from=source)


def test_config_from_fetches_only_configs() -> None:
    files = [
        "model_index.json",
        "scheduler/scheduler_config.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
        "text_encoder/config.json",
        "text_encoder/model-00001-of-00005.safetensors",
        "tokenizer/tokenizer.json",
    ]
    assert list(filter_repo_objects(items=files, allow_patterns=CONFIG_PATTERNS)) == [
        "model_index.json",
        "scheduler/scheduler_config.json",
        "transformer/config.json",
        "text_encoder/config.json",
    ]
