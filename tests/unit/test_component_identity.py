"""Component identities: by content, cached beside the files, and what decides that a replica serves a model."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from families.registry import FAMILIES
from services import component_identity
from services.component_identity import (
    IDENTITY_FILE,
    IdentityError,
    Served,
    checkpoint_identities,
    identify_stage,
    serves,
    stage_components,
)
from services.component_identity import (
    component_identity as identity_of,
)
from tests.helpers.checkpoint_files import fake_checkpoint

WAN_T2V, WAN22_I2V, QWEN = FAMILIES["wan-t2v"], FAMILIES["wan2.2-i2v-a14b"], FAMILIES["qwen-image"]


def _checkpoint(root: Path, pipeline: str = "WanPipeline", text: bytes = b"umt5", vae: bytes = b"vae") -> Path:
    family = WAN22_I2V if pipeline == "WanImageToVideoPipeline" else WAN_T2V
    return fake_checkpoint(root, family, text, vae)


def test_copies_of_the_same_files_have_one_identity_and_any_change_makes_another(tmp_path: Path) -> None:
    first, second = _checkpoint(tmp_path / "t2v"), _checkpoint(tmp_path / "i2v")
    ids = checkpoint_identities(first)
    assert sorted(ids) == ["scheduler", "text_encoder", "tokenizer", "transformer", "vae"]
    theirs = checkpoint_identities(second)
    assert {name for name in ids if ids[name] == theirs[name]} == {"scheduler", "text_encoder", "tokenizer", "vae"}
    (second / "text_encoder" / "model.safetensors").write_bytes(b"umt5-finetuned")
    assert identity_of(second / "text_encoder") != ids["text_encoder"]
    # A renamed file is another component too: the names inside the folder count.
    os.rename(second / "vae" / "model.safetensors", second / "vae" / "other.safetensors")
    assert identity_of(second / "vae") != ids["vae"]


def test_digests_are_cached_beside_the_files_and_read_again_only_when_a_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _checkpoint(tmp_path / "m") / "text_encoder"
    read: list[str] = []
    real = component_identity._file_digest
    monkeypatch.setattr(component_identity, "_file_digest", lambda path: read.append(path.name) or real(path))
    first = identity_of(folder)
    assert sorted(read) == ["config.json", "model.safetensors"] and (folder / IDENTITY_FILE).is_file()
    read.clear()
    assert identity_of(folder) == first and read == []
    weights = folder / "model.safetensors"
    weights.write_bytes(b"other")
    os.utime(weights, ns=(1, 1))
    assert identity_of(folder) != first and read == ["model.safetensors"]


def test_a_folder_that_cannot_be_written_is_hashed_without_a_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _checkpoint(tmp_path / "m") / "vae"
    expected = identity_of(folder)
    (folder / IDENTITY_FILE).unlink()

    def read_only(*args: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(component_identity.os, "replace", read_only)
    assert identity_of(folder) == expected
    assert sorted(path.name for path in folder.iterdir()) == ["config.json", "model.safetensors"]


def test_a_hub_cache_link_gives_its_digest_without_reading_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    digest = "ab" * 32
    (blobs / digest).write_bytes(b"weights")
    folder = tmp_path / "snapshot" / "text_encoder"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").symlink_to(blobs / digest)
    read: list[str] = []
    monkeypatch.setattr(component_identity, "_file_digest", lambda path: read.append(path.name) or "f" * 64)
    first = identity_of(folder)
    assert read == []
    # Other bytes under the same blob name would be another hub file: the name is the identity.
    shutil.copy(blobs / digest, folder / "copy.bin")
    assert identity_of(folder) != first and read == ["copy.bin"]


def test_which_components_each_stage_holds() -> None:
    names = ["processor", "scheduler", "text_encoder", "tokenizer", "transformer", "transformer_2", "vae"]
    assert stage_components("dit", names) == ["scheduler", "transformer", "transformer_2"]
    assert stage_components("vae", names) == ["vae"]
    assert stage_components("text-encoder", names) == ["processor", "text_encoder", "tokenizer"]
    assert stage_components("interp", names) == []


def test_a_replica_serves_a_model_with_the_same_components_and_the_same_family_code() -> None:
    held = {"text_encoder": "sha256:a", "tokenizer": "sha256:t"}
    model = {**held, "vae": "sha256:v", "transformer": "sha256:x"}
    # Wan2.2 I2V encodes prompts with Wan's code: a Wan T2V text encoder serves it.
    assert serves("text-encoder", "encode", WAN_T2V, held, WAN22_I2V, model)
    assert not serves("text-encoder", "encode", WAN_T2V, {**held, "tokenizer": "sha256:other"}, WAN22_I2V, model)
    # Qwen-Image's prompt code differs, whatever the files.
    assert not serves("text-encoder", "encode", WAN_T2V, held, QWEN, model)
    # The VAE decodes for both Wan models, but only an image-to-video family's VAE encodes input images.
    assert serves("vae", "decode", WAN_T2V, {"vae": "sha256:v"}, WAN22_I2V, model)
    assert not serves("vae", "encode", WAN_T2V, {"vae": "sha256:v"}, WAN22_I2V, model)
    assert serves("vae", "encode", WAN22_I2V, {"vae": "sha256:v"}, WAN22_I2V, model)
    assert serves("interp", "", WAN_T2V, {}, QWEN, model)


def test_one_replica_serves_several_checkpoints_only_where_they_share_its_components(tmp_path: Path) -> None:
    t2v = _checkpoint(tmp_path / "t2v")
    i2v = _checkpoint(tmp_path / "i2v", pipeline="WanImageToVideoPipeline")
    other = _checkpoint(tmp_path / "other", text=b"another umt5")
    served = [Served("t2v", t2v, WAN_T2V), Served("i2v", i2v, WAN22_I2V)]
    identity = identify_stage("text-encoder", served)
    assert identity.models == ("t2v", "i2v") and sorted(identity.components) == ["text_encoder", "tokenizer"]
    assert identity.model_components == {}
    with pytest.raises(IdentityError, match=r"--also-serve .*other: its text_encoder differ from --model"):
        identify_stage("text-encoder", [served[0], Served("other", other, WAN_T2V)])
    # The VAE replica runs --model's family code: a text-to-video one cannot encode the I2V model's images.
    with pytest.raises(IdentityError, match=r"wan2.2-i2v-a14b runs its vae encode with .*give .*i2v as --model"):
        identify_stage("vae", served)
    assert identify_stage("vae", served[::-1]).models == ("i2v", "t2v")
    # The DiT reports its whole checkpoint, for the other stages to be matched against.
    dit = identify_stage("dit", served[:1])
    assert sorted(dit.components) == ["scheduler", "transformer"]
    assert dit.model_components == checkpoint_identities(t2v)
