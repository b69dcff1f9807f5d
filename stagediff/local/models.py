"""Several models in one local cluster: a DiT per model, the other stages shared where the files are the same.

`stagediff up --model A --model B` serves both behind one orchestrator. The compose file describes one model's
stages (each mounts it at /models/model); `for_models` shapes them for several:

- each model is mounted at /models/<its id> (the directory's name, as a stage serves it);
- the DiT runs once per model (`dit.<id>`);
- the text encoder and the VAE run once per pool of models whose components for the stage are the same files
  (services/component_identity.py): one process loads --model's weights and serves the others with
  `--also-serve`. The model loaded is one whose family code serves all of the pool (an image-to-video VAE, which
  also encodes input images, before a text-to-video one). A pool of one model is named `<stage>.<id>`, the only
  pool of a stage keeps the stage's name;
- the interpolator reads no checkpoint: one serves every model;
- every reference to a stage in a command (`--dit dit:50062`) and in depends_on becomes all of its services.

With one model nothing changes. The compose file's stages must be one service each (`--replicas` and `<stage>-N`
services are for one model).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from families.base import Family
from families.registry import REGISTRY, family_for_index
from services.component_identity import IdentityError, Served, identify_stage
from services.model_source import model_id_of
from services.stage_table import STAGES
from stagediff.local.compose import ComposeService, replica_groups

MODEL_MOUNT = "/models/model"  # where the compose file mounts the model
_SERVICE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class LocalModel:
    """A model `up` serves: its id, its directory on this machine and its family."""

    model_id: str
    path: Path
    family: Family

    @property
    def mount(self) -> str:
        return f"/models/{self.model_id}"

    @property
    def served(self) -> Served:
        return Served(self.model_id, self.path, self.family)


def checkpoint_family(model_dir: Path) -> Family:
    """The family of the checkpoint in `model_dir` (its model_index.json), which decides the stages to run."""
    index_file = model_dir / "model_index.json"
    try:
        index = json.loads(index_file.read_text())
    except OSError as error:
        raise ValueError(f"--model {model_dir}: {error.strerror or error} reading model_index.json") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--model {model_dir}: model_index.json is not valid JSON ({error})") from None
    family = family_for_index(index) if isinstance(index, dict) else None
    if family is None:
        pipeline = index.get("_class_name") if isinstance(index, dict) else None
        raise ValueError(
            f"--model {model_dir}: model_index.json names the pipeline {pipeline!r}, which this build does not "
            f"serve; it serves {', '.join(REGISTRY)}"
        )
    return family


def local_models(dirs: list[Path]) -> list[LocalModel]:
    """The models of `--model` directories: each one's id is the directory's name (a Hub snapshot's: its
    repository's name), so no two may share one."""
    models = [LocalModel(model_id_of(path), path, checkpoint_family(path)) for path in dirs]
    ids = [model.model_id for model in models]
    repeated = sorted({model_id for model_id in ids if ids.count(model_id) > 1})
    if repeated:
        raise ValueError(
            f"--model: several directories are named {', '.join(repeated)}; a model's id is its directory's name, "
            "so give each model a directory of its own name"
        )
    return models


def pools(stage: str, models: list[LocalModel]) -> list[list[LocalModel]]:
    """The models grouped by what one `stage` process can serve, each pool's loaded model first."""
    if not STAGES[stage].shares_components:
        return [[model] for model in models]
    grouped: list[list[LocalModel]] = []
    for model in models:
        for index, pool in enumerate(grouped):
            joined = _joined(stage, pool, model)
            if joined is not None:
                grouped[index] = joined
                break
        else:
            grouped.append([model])
    return grouped


def _joined(stage: str, pool: list[LocalModel], model: LocalModel) -> list[LocalModel] | None:
    """`pool` with `model` served by the same `stage` process (as --also-serve, else as the one loaded), or None
    where its components for the stage are not the same files."""
    for candidate in ([*pool, model], [model, *pool]):
        try:
            identify_stage(stage, [member.served for member in candidate])
        except IdentityError:
            continue
        return candidate
    return None


def for_models(services: dict[str, ComposeService], models: list[LocalModel]) -> dict[str, ComposeService]:
    """The services that serve every model of `models` (see the module docstring); unchanged for one model."""
    if len(models) < 2:
        return services
    groups = replica_groups(services)
    replicated = sorted(stage for stage, names in groups.items() if len(names) > 1)
    if replicated:
        raise ValueError(
            f"several --model: the stages {', '.join(replicated)} run several services in the compose file; "
            "with several models each stage must be one service (and --replicas is for one model)"
        )
    clones: dict[str, list[str]] = {}
    shaped: dict[str, ComposeService] = {}
    for name, service in services.items():
        kind = service.stage_kind
        if kind is None or kind == "interp" or MODEL_MOUNT not in service.command:
            continue
        stage_pools = pools(kind, models)
        clones[name] = []
        for pool in stage_pools:
            clone = name if len(stage_pools) == 1 else f"{name}.{_SERVICE_NAME.sub('-', pool[0].model_id)}"
            clones[name].append(clone)
            shaped[clone] = _serving(service, clone, pool)
    references = {
        f"{name}:{services[name].container_port}": ",".join(
            f"{clone}:{services[name].container_port}" for clone in names
        )
        for name, names in clones.items()
    }
    result: dict[str, ComposeService] = {}
    for name, service in services.items():
        if name in clones:
            for clone in clones[name]:
                result[clone] = _with_references(shaped[clone], references, clones)
        else:
            result[name] = _with_references(service, references, clones)
    return result


def _serving(service: ComposeService, name: str, pool: list[LocalModel]) -> ComposeService:
    """`service` (a stage reading the checkpoint at MODEL_MOUNT) serving `pool`: its first model loaded, the others
    given with --also-serve, each mounted at its own path."""
    loaded, *others = pool
    command = [loaded.mount if arg == MODEL_MOUNT else arg for arg in service.command]
    for other in others:
        command += ["--also-serve", other.mount]
    volumes = [(source, target) for source, target in service.volumes if target != MODEL_MOUNT]
    volumes += [(str(model.path), model.mount) for model in pool]
    return replace(service, name=name, command=command, volumes=volumes, origin=service.name)


def _with_references(
    service: ComposeService, references: dict[str, str], clones: dict[str, list[str]]
) -> ComposeService:
    """Every SERVICE:PORT of a cloned stage in the command made all its clones, and depends_on likewise."""

    def expanded(text: str) -> str:
        return ",".join(references.get(part, part) for part in text.split(","))

    command = []
    for arg in service.command:
        option, equals, inline = arg.partition("=")
        command.append(f"{option}={expanded(inline)}" if equals and option.startswith("--") else expanded(arg))
    depends_on: dict[str, str] = {}
    for dependency, condition in service.depends_on.items():
        for clone in clones.get(dependency, [dependency]):
            depends_on.setdefault(clone, condition)
    return replace(service, command=command, depends_on=depends_on)
