"""A Hugging Face Hub cache holding a local checkpoint, as `snapshot_download` lays one out.

No Hub is reachable where the tests run, so a checkpoint written by `init_model` is put into a cache by hand:
`<cache>/models--ORG--NAME/blobs/<id>` holds each file once (LFS files, the weights, named by their SHA-256;
the others by their git blob id, as the Hub names them), `snapshots/<commit>/<path>` links to the blob, and
`refs/<branch>` holds the commit. `cache_checkpoint` checks the result with the library's own readers
(`scan_cache_dir`, `try_to_load_from_cache`), which must accept it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from huggingface_hub import scan_cache_dir, try_to_load_from_cache
from huggingface_hub.file_download import repo_folder_name

from services.component_identity import IDENTITY_FILE

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


def blob_name(file: Path) -> str:
    """The name the Hub cache gives `file`'s blob: the SHA-256 of an LFS file, the git blob id of the others."""
    data = file.read_bytes()
    if file.suffix in LFS_SUFFIXES:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_checkpoint(
    checkpoint: Path, cache: Path, repo_id: str, commit: str = COMMIT, refs: tuple[str, ...] = ("main",)
) -> Path:
    """Puts `checkpoint` into the Hub cache `cache` as `repo_id` at `commit` (each of `refs` pointing at it) and
    returns the snapshot folder."""
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = storage / "snapshots" / commit
    for file in sorted(checkpoint.rglob("*")):
        if not file.is_file() or file.name == IDENTITY_FILE:
            continue
        blob = storage / "blobs" / blob_name(file)
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(checkpoint)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    _check_with_the_library(cache, repo_id, commit, refs)
    return snapshot


def _check_with_the_library(cache: Path, repo_id: str, commit: str, refs: tuple[str, ...]) -> None:
    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (repo,) = [repo for repo in info.repos if repo.repo_id == repo_id]
    (revision,) = repo.revisions
    assert revision.commit_hash == commit and set(revision.refs) == set(refs)
    for revision_name in (commit, *refs):
        found = try_to_load_from_cache(repo_id, "model_index.json", cache_dir=cache, revision=revision_name)
        assert isinstance(found, str) and Path(found).is_file(), (revision_name, found)
