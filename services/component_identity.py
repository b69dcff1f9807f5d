"""What a checkpoint's components are, by content: what lets one stage replica serve several models.

A diffusers checkpoint is a folder of components (model_index.json names them: `text_encoder`, `tokenizer`,
`vae`, `transformer`, `scheduler`, ...). A component's identity is a digest of its files' bytes: two
checkpoints whose `text_encoder` folders hold the same files hold the same text encoder, wherever they lie. Wan2.1
and Wan2.2's text-to-video and image-to-video checkpoints ship the same UMT5-XXL, so a text-encoder replica
loaded from one serves all of them.

Rules a reader needs:
- The identity is `sha256:<hex>` over each file's path inside the component and its own SHA-256. A file
  reached through a Hugging Face hub cache link (`.../blobs/<64 hex digits>`) has its SHA-256 in its target's
  name and is not read. Any other file is read once: the digests are cached in `.stagediff-identity.json`
  inside the component, keyed by each file's size and modification time, and read again only when one changes.
  A folder that cannot be written (a read-only volume) is hashed again at every start, which is logged.
- Which components a stage holds is a rule, not a table per family (`STAGE_COMPONENTS`): the DiT holds the
  transformers and the scheduler, the VAE stage the VAE, and the text-encoder stage everything else the index
  names (tokenizers, text and image encoders, processors). The interpolator holds none of the checkpoint's.
- A replica of a stage serves a model's calls there (`serves`) when it holds the same components (by identity)
  that the model's checkpoint has for that stage and runs the same family code for the call. Both sides come
  from StageInfo: a stage reports `components` (what it holds), the DiT `model_components` (its whole checkpoint).

Imports nothing heavy: the orchestrator and `stagediff up` read it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from families.base import Family

logger = logging.getLogger(__name__)

IDENTITY_FILE = ".stagediff-identity.json"
_CACHE_VERSION = 1
_HUB_BLOB = re.compile(r"^[0-9a-f]{64}$")
_HASH_THREADS = 4  # hashlib releases the GIL: files are read in parallel
# The DiT's and the VAE's components; the text-encoder stage holds the rest of the checkpoint's.
_DIT_COMPONENTS = ("transformer", "transformer_2", "scheduler")
_VAE_COMPONENTS = ("vae",)
# The family code a stage runs for each kind of call on it: a replica serves a model's call only with the same.
STAGE_OPERATIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "text-encoder": {"encode": ("text_encoder",)},
    "vae": {"decode": ("decoder",), "encode": ("image_encoder",)},
}


class IdentityError(ValueError):
    """A component folder could not be read, or checkpoints given to one replica do not share its components."""


@dataclass(frozen=True)
class StageIdentity:
    """What a stage replica reports of its checkpoints (StageInfo's components, model_components, models)."""

    components: dict[str, str]
    """The components it holds, each with its identity."""
    model_components: dict[str, str]
    """Every component of its checkpoint (the DiT's; empty for the other stages)."""
    models: tuple[str, ...]
    """The model ids it serves: --model's, then each --also-serve's."""


@dataclass(frozen=True)
class Served:
    """One checkpoint a replica serves: its model id, its folder and its family."""

    model_id: str
    path: Path
    family: Family


def stage_components(stage: str, components: Iterable[str]) -> list[str]:
    """The names among `components` (a checkpoint's) that `stage` holds, sorted."""
    if stage == "dit":
        return sorted(name for name in components if name in _DIT_COMPONENTS)
    if stage == "vae":
        return sorted(name for name in components if name in _VAE_COMPONENTS)
    if stage == "text-encoder":
        return sorted(name for name in components if name not in (*_DIT_COMPONENTS, *_VAE_COMPONENTS))
    return []


def checkpoint_component_names(root: Path) -> list[str]:
    """The components model_index.json names and the checkpoint has a folder for (a `[null, null]` entry is a
    component left out)."""
    try:
        index = json.loads((root / "model_index.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise IdentityError(f"{root / 'model_index.json'}: {error}") from None
    return sorted(
        name
        for name, entry in index.items()
        if isinstance(entry, list) and len(entry) == 2 and entry[1] is not None and (root / name).is_dir()
    )


def checkpoint_identities(root: str | Path, names: list[str] | None = None) -> dict[str, str]:
    """Each component's identity (of `names`, or of every component the checkpoint has)."""
    root = Path(root)
    return {name: component_identity(root / name) for name in (names or checkpoint_component_names(root))}


def identify_stage(stage: str, served: Sequence[Served]) -> StageIdentity:
    """The identity of a replica of `stage` serving `served` (--model first, then each --also-serve). Raises
    IdentityError when another checkpoint's components for this stage are not the same files as the first's, or
    when its family runs code for this stage that the first's does not (the replica runs the first's)."""
    first = served[0]
    names = stage_components(stage, checkpoint_component_names(first.path))
    model_components = checkpoint_identities(first.path) if stage == "dit" else {}
    held = {name: model_components[name] for name in names} if stage == "dit" else {}
    if names and not held:
        held = checkpoint_identities(first.path, names)
    for other in served[1:]:
        theirs = checkpoint_identities(other.path, stage_components(stage, checkpoint_component_names(other.path)))
        differing = sorted(name for name in {*held, *theirs} if held.get(name) != theirs.get(name))
        if differing:
            raise IdentityError(
                f"--also-serve {other.path}: its {', '.join(differing)} differ from --model {first.path}'s; one "
                f"{stage} replica serves only checkpoints whose {stage} components are the same files"
            )
        for operation, parts in STAGE_OPERATIONS.get(stage, {}).items():
            for part in parts:
                code = getattr(other.family, part)
                if code and code != getattr(first.family, part):
                    raise IdentityError(
                        f"--also-serve {other.path}: {other.family.name} runs its {stage} {operation} with {code}, "
                        f"which --model's {first.family.name} does not; give {other.path} as --model instead"
                    )
    return StageIdentity(
        components=held, model_components=model_components, models=tuple(item.model_id for item in served)
    )


def component_identity(folder: Path) -> str:
    """`sha256:<hex>` of a component folder's files (their paths inside it and their digests)."""
    files = sorted(
        path
        for path in folder.rglob("*")
        if path.is_file() and path.name != IDENTITY_FILE and ".cache" not in path.parts
    )
    cache_path = folder / IDENTITY_FILE
    cached = _read_cache(cache_path)
    digests: dict[str, str] = {}
    stats: dict[str, list[int]] = {}
    to_hash: list[Path] = []
    for path in files:
        relative = path.relative_to(folder).as_posix()
        stat = path.stat()
        stats[relative] = [stat.st_size, stat.st_mtime_ns]
        known = cached.get(relative)
        if known is not None and known[:2] == stats[relative]:
            digests[relative] = known[2]
        elif (hub := _hub_digest(path)) is not None:
            digests[relative] = hub
        else:
            to_hash.append(path)
    if to_hash:
        with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
            for path, digest in zip(to_hash, pool.map(_file_digest, to_hash), strict=True):
                digests[path.relative_to(folder).as_posix()] = digest
        _write_cache(cache_path, {name: [*stats[name], digests[name]] for name in digests})
    whole = hashlib.sha256()
    for name in sorted(digests):
        whole.update(f"{name}\0{digests[name]}\n".encode())
    return f"sha256:{whole.hexdigest()}"


def serves(
    stage: str,
    operation: str,
    replica_family: Family,
    replica_components: Mapping[str, str],
    model_family: Family,
    model_components: Mapping[str, str],
) -> bool:
    """Whether a replica of `stage` (its family, the components it holds) serves a model's `operation` there
    (the model's family, its checkpoint's components): the same family code for the call, and the same
    components by identity. A stage that holds none of the checkpoint's (the interpolator) serves every model."""
    for part in STAGE_OPERATIONS.get(stage, {}).get(operation, ()):
        code = getattr(model_family, part)
        if not code or getattr(replica_family, part) != code:
            return False
    needed = {name: model_components[name] for name in stage_components(stage, model_components)}
    return all(replica_components.get(name) == identity for name, identity in needed.items())


def _hub_digest(path: Path) -> str | None:
    """The SHA-256 a Hugging Face hub cache gives a file in its blob's name, or None."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    return target.name if target.parent.name == "blobs" and _HUB_BLOB.match(target.name) else None


def _file_digest(path: Path) -> str:
    try:
        with path.open("rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    except OSError as error:
        raise IdentityError(f"{path}: {error.strerror}") from None


def _read_cache(path: Path) -> dict[str, list]:
    try:
        cache = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if (
        not isinstance(cache, dict)
        or cache.get("version") != _CACHE_VERSION
        or not isinstance(cache.get("files"), dict)
    ):
        return {}
    return {name: entry for name, entry in cache["files"].items() if isinstance(entry, list) and len(entry) == 3}


def _write_cache(path: Path, files: dict[str, list]) -> None:
    """Writes the digests beside the files (atomically: stages starting together may write it at once)."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps({"version": _CACHE_VERSION, "files": files}, indent=0, sort_keys=True))
        os.replace(temporary, path)
    except OSError as error:
        logger.info("%s: not cached (%s); its files are hashed again at the next start", path.parent, error.strerror)
        temporary.unlink(missing_ok=True)
