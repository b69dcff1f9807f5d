"""deploy/docker-compose.two-models.yml: two models behind one orchestrator, a DiT each, one text encoder and one
VAE serving both with --also-serve; read as `stagediff up -f` reads it (stagediff/local/compose.py), each command
parsed by the real parser of the service it starts (docker-compose's own reading: tests/e2e/test_local_cluster_up.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.stage_table import STAGES
from stagediff.local.compose import ComposeService, load_compose, replica_groups
from tests.helpers.compose import DEPLOY, dit_world_size, gateway_refusal
from tests.helpers.secure_defaults import startup_refusal
from tests.helpers.serving import parse_serve

TWO_MODELS_FILE = DEPLOY / "docker-compose.two-models.yml"
# Each model's checkpoint on the host (its variable) and where the stages mount it; the mount's name is the model id.
MODELS = {"wan-t2v": "STAGEDIFF_T2V_MODEL_DIR", "wan-i2v": "STAGEDIFF_I2V_MODEL_DIR"}
HOST_DIRS = {variable: f"/data/{model_id}-checkpoint" for model_id, variable in MODELS.items()}
SHARED_STAGES = ("text-encoder", "vae")


def _parsed(service: ComposeService) -> Any:
    """The service's command as its own parser reads it, over the STAGEDIFF_* environment the file gives it."""
    with pytest.MonkeyPatch.context() as patch:
        for key in [key for key in os.environ if key.startswith("STAGEDIFF_")]:
            patch.delenv(key)
        for key, value in service.environment.items():
            patch.setenv(key, value)
        return parse_serve(service.command[1:])


@pytest.fixture(scope="module")
def services() -> dict[str, ComposeService]:
    return load_compose(TWO_MODELS_FILE, dict(HOST_DIRS))


@pytest.fixture(scope="module")
def parsed(services: dict[str, ComposeService]) -> dict[str, Any]:
    return {name: _parsed(service) for name, service in services.items()}


def _of_stage(services: dict[str, ComposeService], stage: str) -> list[str]:
    return [name for name, service in services.items() if service.stage_kind == stage]


def test_one_text_encoder_and_one_vae_serve_both_models(
    services: dict[str, ComposeService], parsed: dict[str, Any]
) -> None:
    mounts = {f"/models/{model_id}" for model_id in MODELS}
    for stage in SHARED_STAGES:
        (name,) = _of_stage(services, stage)
        args = parsed[name]
        assert len(args.also_serve) == 1, name
        assert {args.model, *args.also_serve} == mounts, f"{name}: --model and --also-serve name the other model"
    # The VAE loads the image-to-video checkpoint: only its family encodes input images.
    assert parsed["vae"].model == "/models/wan-i2v" and parsed["text-encoder"].model == "/models/wan-t2v"


def test_one_dit_per_model_and_the_orchestrator_is_given_every_stage(
    services: dict[str, ComposeService], parsed: dict[str, Any]
) -> None:
    dits = _of_stage(services, "dit")
    assert sorted(Path(parsed[name].model).name for name in dits) == sorted(MODELS), "a DiT per model"
    # No `<stage>-N` name: that would make a DiT a replica of another model's.
    assert all(members == [stage] for stage, members in replica_groups(services).items())
    (orchestrator,) = [name for name, service in services.items() if service.is_entry]
    args = parsed[orchestrator]
    for stage in STAGES:
        given = getattr(args, stage.replace("-", "_")).split(",")
        expected = [f"{name}:{services[name].container_port}" for name in _of_stage(services, stage)]
        assert given == expected, f"--{stage}: every service of the stage, of either model"
    required = {name for name, service in services.items() if service.stage_kind in ("text-encoder", "dit", "vae")}
    assert services[orchestrator].depends_on == dict.fromkeys(required, "service_healthy")


def test_every_stage_mounts_the_checkpoints_it_reads_read_only(
    services: dict[str, ComposeService], parsed: dict[str, Any]
) -> None:
    host_of = {f"/models/{model_id}": HOST_DIRS[variable] for model_id, variable in MODELS.items()}
    declared = yaml.safe_load(TWO_MODELS_FILE.read_text())["services"]
    for name, service in services.items():
        mounted = dict((target, source) for source, target in service.volumes)
        if not STAGES.get(service.stage_kind or "") or not STAGES[service.stage_kind].reads_checkpoint:
            assert not [target for target in mounted if target.startswith("/models/")], name
            continue
        args = parsed[name]
        read = [args.model, *getattr(args, "also_serve", [])]
        assert {target for target in mounted if target.startswith("/models/")} <= {*read, "/models/model"}, name
        for path in read:
            assert mounted.get(path) == host_of[path], f"{name}: {path} is not its model's checkpoint"
        # common-services.yml's /models/model mount, which `extends` keeps: the loaded checkpoint, never a default.
        assert mounted.get("/models/model", host_of[args.model]) == host_of[args.model], name
        assert all(str(spec).endswith(":ro") for spec in declared[name]["volumes"]), f"{name}: mounted writable"


def test_every_service_starts_under_the_secure_defaults_on_its_own_gpus(
    services: dict[str, ComposeService], parsed: dict[str, Any]
) -> None:
    """The file keeps docker-compose.yml's secrets and env files: each command passes its startup checks; no two
    stages share a GPU, and each group's ranks are the GPUs it reserves."""
    for name, service in services.items():
        args = parsed[name]
        assert args.host == "0.0.0.0", name
        if service.is_http:
            assert gateway_refusal(args) is None, name
            continue
        assert startup_refusal(service.command[1], args, args.cluster_secret_file is not None) is None, name
    reserved = [gpu for service in services.values() for gpu in service.gpu_device_ids]
    assert len(reserved) == len(set(reserved)) == 8, "one 8-GPU server, each GPU to one stage"
    for name in _of_stage(services, "dit"):
        args = parsed[name]
        ranks = dit_world_size(args)
        assert ranks == len(services[name].gpu_device_ids), name
    (vae,) = _of_stage(services, "vae")
    assert parsed[vae].vae_patch_parallel_size == len(services[vae].gpu_device_ids)
