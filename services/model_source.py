"""Where `--model` comes from: a checkpoint directory on this machine, or a Hugging Face Hub id.

`stagediff up` and `stagediff serve <stage>` take either, and resolve it here to the local directory they load
(`stagediff init-model --config-from`, to the configs alone: `resolve_configs`):

- A path that exists wins: it must be a diffusers checkpoint directory (with model_index.json).
- Otherwise `ORG/NAME[@REVISION]` (exactly one slash before the `@`, each part of the Hub's characters:
  letters, digits, `-`, `_`, `.`) is a Hub id. `./x/y`, `/x/y`, `~/x` and `x/y/z` are paths.
- A Hub id resolves through huggingface_hub's `snapshot_download`: its cache, HF_HOME, HF_HUB_CACHE,
  HF_HUB_OFFLINE and its token (HF_TOKEN or `hf auth login`) as the library reads them. The snapshot directory in
  the cache is what the stages load, so the components' identities (services/component_identity.py) come from
  the cache's blob names. Only the files the given stages read are fetched (`stage_patterns`): model_index.json,
  the defaults file, the configs every stage reads (scheduler, the transformers' and the VAE's config.json),
  and the component folders each stage holds; the DiT fetches every component, since it reports the whole
  checkpoint's identities, by which the orchestrator routes the model's calls to the other stages.
- A Hub snapshot's model id is its repository's NAME (`model_id_of`), not the commit its folder is named by.

Every failure is a ModelSourceError whose message is one line: which of a missing directory, a directory that
is not a checkpoint or an unknown Hub id it was, and what to run instead. huggingface_hub is imported only when
a Hub id is resolved.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from families.base import DEFAULTS_FILE
from services.component_identity import stage_components

INDEX_FILE = "model_index.json"
# Configs every stage reads before loading anything (services/checkpoint.py, the families' denoise and encode).
SHARED_CONFIGS = ("scheduler/*", "transformer/config.json", "transformer_2/config.json", "vae/config.json")
# What `init-model --config-from` reads of a checkpoint: no weights.
CONFIG_PATTERNS = [INDEX_FILE, "scheduler/*", "*/config.json"]
# The Hub's repository names: letters, digits, '-', '_' and '.', not starting or ending with '-' or '.'.
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"(?P<org>{_HUB_PART})/(?P<name>{_HUB_PART})(?:@(?P<revision>[^\s@]+))?")
# A Hub cache's snapshot folder: <cache>/models--ORG--NAME/snapshots/<commit>.
_CACHE_REPO = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)")
INIT_MODEL_HINT = "stagediff init-model --family wan-t2v --preset tiny --out {path}"


class ModelSourceError(ValueError):
    """`--model` names no checkpoint this machine has or can fetch: one line saying which and what to do."""


@dataclass(frozen=True)
class HubId:
    """`ORG/NAME[@REVISION]`: a Hub model repository and, optionally, its branch, tag or commit."""

    repo_id: str
    revision: str | None = None

    @property
    def name(self) -> str:
        return self.repo_id.partition("/")[2]

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_hub_id(text: str) -> HubId | None:
    """The Hub id `text` spells (see the module docstring), or None where it is a path. Existence is not checked."""
    match = _HUB_ID.fullmatch(text)
    if match is None or ".." in match["org"] or ".." in match["name"]:
        return None
    return HubId(f"{match['org']}/{match['name']}", match["revision"])


def model_id_of(path: Path) -> str:
    """The model id a checkpoint directory serves under: its NAME for a Hub cache snapshot
    (`models--ORG--NAME/snapshots/<commit>`), else the directory's name."""
    resolved = path.resolve()
    repo = _CACHE_REPO.fullmatch(resolved.parent.parent.name) if resolved.parent.name == "snapshots" else None
    return repo["name"] if repo is not None else resolved.name


def resolve_model(text: str, stages: Iterable[str], *, flag: str = "--model") -> Path:
    """The checkpoint directory `text` names, fetched from the Hub for `stages` where it is a Hub id (see the
    module docstring); ModelSourceError naming `flag` otherwise."""
    path = Path(text).expanduser()
    if path.exists():
        return checked_checkpoint(path, flag)
    hub_id = parse_hub_id(text)
    if hub_id is None:
        raise ModelSourceError(
            f"{flag} {text}: no such directory; write a local demo checkpoint with "
            f"`{INIT_MODEL_HINT.format(path=text)}`, or give a Hugging Face Hub id ORG/NAME[@REVISION]"
        )
    return fetch(hub_id, stage_patterns_for(hub_id, stages, flag), flag)


def resolve_configs(text: str, flag: str = "--config-from") -> Path:
    """The checkpoint `text` names with (at least) its configs: a local directory as it is, a Hub id with only
    model_index.json, the scheduler and each component's config.json fetched (for `init-model`'s config presets)."""
    path = Path(text).expanduser()
    if path.exists():
        return checked_checkpoint(path, flag)
    hub_id = parse_hub_id(text)
    if hub_id is None:
        raise ModelSourceError(f"{flag} {text}: no such directory, and not a Hugging Face Hub id ORG/NAME[@REVISION]")
    return fetch(hub_id, CONFIG_PATTERNS, flag)


def checked_checkpoint(path: Path, flag: str = "--model") -> Path:
    """`path` (which exists) if it is a checkpoint directory; ModelSourceError saying what it is otherwise."""
    if not path.is_dir():
        raise ModelSourceError(f"{flag} {path}: a file, not a directory; give the checkpoint's directory")
    if not (path / INDEX_FILE).is_file():
        raise ModelSourceError(
            f"{flag} {path}: the directory has no {INDEX_FILE}, so it is not a diffusers checkpoint; give the "
            f"checkpoint's top directory, or write a demo one with `{INIT_MODEL_HINT.format(path=path)}`"
        )
    return path.resolve()


def stage_patterns(index: dict, stages: Iterable[str]) -> list[str]:
    """The files (`allow_patterns`) that `stages` read of a checkpoint whose model_index.json is `index`."""
    named = [name for name, entry in index.items() if isinstance(entry, list) and len(entry) == 2 and entry[1]]
    held: set[str] = set()
    for stage in stages:
        held.update(named if stage == "dit" else stage_components(stage, named))
    return [INDEX_FILE, DEFAULTS_FILE, *SHARED_CONFIGS, *(f"{name}/*" for name in sorted(held))]


def stage_patterns_for(hub_id: HubId, stages: Iterable[str], flag: str) -> list[str]:
    """`stage_patterns` of the Hub model, whose model_index.json is fetched first."""
    snapshot = fetch(hub_id, [INDEX_FILE, DEFAULTS_FILE], flag)
    if not (snapshot / INDEX_FILE).is_file():
        raise ModelSourceError(
            f"{flag} {hub_id}: the Hugging Face Hub model has no {INDEX_FILE}, so it is not in the diffusers layout "
            "(the diffusers version of a model is often a repository named ...-Diffusers)"
        )
    try:
        index = json.loads((snapshot / INDEX_FILE).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelSourceError(f"{flag} {hub_id}: its {INDEX_FILE} cannot be read ({error})") from None
    if not isinstance(index, dict):
        raise ModelSourceError(f"{flag} {hub_id}: its {INDEX_FILE} is not a JSON object")
    return stage_patterns(index, stages)


def fetch(hub_id: HubId, patterns: list[str], flag: str = "--model") -> Path:
    """The snapshot directory of `hub_id` with the files of `patterns`, from the cache or downloaded."""
    import huggingface_hub
    from huggingface_hub import errors

    try:
        folder = huggingface_hub.snapshot_download(hub_id.repo_id, revision=hub_id.revision, allow_patterns=patterns)
    except errors.GatedRepoError:
        raise ModelSourceError(
            f"{flag} {hub_id}: the model is gated; accept its terms on https://huggingface.co/{hub_id.repo_id} "
            "and log in (`hf auth login` or HF_TOKEN)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ModelSourceError(
            f"{flag} {hub_id}: no such directory, and no such model on the Hugging Face Hub (a private one needs "
            f"`hf auth login` or HF_TOKEN); for a local demo checkpoint run `{INIT_MODEL_HINT.format(path=hub_id)}`"
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelSourceError(
            f"{flag} {hub_id}: the Hugging Face Hub model {hub_id.repo_id} has no revision {hub_id.revision}; "
            "give a branch, tag or commit it has"
        ) from None
    except errors.LocalEntryNotFoundError as error:
        where = "is not complete in" if isinstance(error, errors.IncompleteSnapshotError) else "is not in"
        raise ModelSourceError(
            f"{flag} {hub_id}: no such directory, and the Hugging Face Hub model {where} the Hub cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}) while the Hub cannot be reached (HF_HUB_OFFLINE or no "
            f"network); fetch it with `hf download {hub_id.repo_id}` where the Hub is reachable, or for a local "
            f"demo checkpoint run `{INIT_MODEL_HINT.format(path=hub_id)}`"
        ) from None
    except (errors.HfHubHTTPError, errors.HFValidationError, OSError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelSourceError(f"{flag} {hub_id}: fetching it from the Hugging Face Hub failed: {first_line}") from None
    return Path(folder)


def stage_model(stage: str, text: str | None, flag: str = "--model") -> str | None:
    """`--model` (or an `--also-serve`) of `stagediff serve <stage>` as the local directory it names, fetched for
    `stage` where it is a Hub id; None stays None (a stage that reads no checkpoint). A problem exits in one line."""
    if text is None:
        return None
    try:
        return str(resolve_model(text, (stage,), flag=flag))
    except ModelSourceError as error:
        raise SystemExit(f"stagediff serve {stage}: {error}") from None
