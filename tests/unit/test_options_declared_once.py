"""Every option is declared once, by the parser of the service that takes it.

`stagediff up` repeats the stage options it passes on exactly as their stages declare them (it declares its
options on the client's side, where the stages cannot be read), the deploy/env files set options by their
variable, the orchestrator's endpoint flags follow the stage kinds: each must name an option of the parser it
reaches, and that parser must be buildable without torch (the CLI, `up` and these tests read it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.environment_options import (
    NOT_OPTIONS,
    Declaration,
    declarations,
    declared_options,
    options_module,
    parse_args,
)
from services.stage_table import SERVE_TARGETS, STAGES
from stagediff.local import up
from stagediff.local.compose import load_compose
from stagediff.up_options import STAGE_OPTIONS, StageOption

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE_FILES = [
    DEPLOY / "docker-compose.yml",
    DEPLOY / "docker-compose.single-gpu.yml",
    DEPLOY / "docker-compose.cpu.yml",
]
# Two models behind one orchestrator: its own services (dit-t2v, dit-i2v), so the overrides do not apply.
TWO_MODELS_COMPOSE_FILE = DEPLOY / "docker-compose.two-models.yml"
# Replicated orchestrators beside servers that are not StageDiff's (a proxy, PostgreSQL, SeaweedFS).
HA_COMPOSE_FILE = DEPLOY / "docker-compose.ha.yml"


# Overrides, applied on top of docker-compose.yml.
OVERRIDES = [DEPLOY / "docker-compose.stage-tls.yml", DEPLOY / "docker-compose.image.yml"]


# `KEY=VALUE` lines of an env file, and the `# STAGEDIFF_KEY=...` examples its comments give.
_SETTING = re.compile(r"^\s*(?:#\s*)?(STAGEDIFF_[A-Z0-9_]+)=", re.MULTILINE)


@pytest.mark.parametrize("target", list(SERVE_TARGETS))
def test_the_parser_a_service_runs_is_its_options_module(target: str) -> None:
    """main() parses with build_parser(): the recorded declarations are the options the service accepts."""
    parser = options_module(target).build_parser()
    assert parser.prog == f"stagediff serve {target}"
    declared = declarations(options_module(target).add_arguments)
    assert declared, target
    for declaration in declared:
        # No option renames its dest: the variable read (STAGEDIFF_<FIRST LONG NAME>) and the one
        # warned about as naming no option (STAGEDIFF_<DEST>) are the same.
        assert "dest" not in declaration.options, (target, declaration.flag)
    names = [name for declaration in declared for name in declaration.names]
    assert len(names) == len(set(names)), f"{target} declares an option twice"


def _as_up_declares_it(declaration: Declaration) -> dict[str, Any]:
    """A stage's declaration as `up` repeats it (stagediff/up_options.py): no default, which up leaves to the
    stage, and the stage's default written into the help."""
    options = {key: value for key, value in declaration.options.items() if key != "default"}
    default = declaration.options.get("default")
    if "%(default)s" in options.get("help", ""):
        options["help"] = options["help"].replace("%(default)s", str(default))
    elif "default" not in options.get("help", "") and default not in (None, False, "", []):
        options["help"] = f"{options['help']} (default: {default})"
    return options


@pytest.mark.parametrize("option", STAGE_OPTIONS, ids=lambda option: option.flag)
def test_every_stage_option_of_up_is_what_its_stage_declares(option: StageOption) -> None:
    """`up` declares its options on the client's side, where the stages cannot be read: each stage option is
    a copy of the one its stage declares, and only that stage declares it."""
    declaring = [target for target in SERVE_TARGETS if option.flag in declared_options(target)]
    assert declaring == [option.stage], f"{option.flag} is declared by {declaring}, not by {option.stage} alone"
    assert option.stage in STAGES, f"{option.flag} goes to {option.stage}, which is not a stage"
    declaration = declared_options(option.stage)[option.flag]
    assert option.names == declaration.names
    assert option.options == _as_up_declares_it(declaration), f"copy {option.flag} from its stage"


def _a_value(options: dict) -> list[str]:
    """Command-line tokens of a valid value for an option declared with `options` (none for a switch)."""
    if options.get("action") == "store_true":
        return []
    if options.get("choices"):
        return [str(options["choices"][-1])]
    return [{int: "3", float: "0.25"}.get(options.get("type"), "a-value")]


@pytest.mark.parametrize("option", STAGE_OPTIONS, ids=lambda option: option.flag)
def test_a_forwarded_option_means_in_up_what_it_means_to_its_stage(option: StageOption) -> None:
    tokens = [option.flag, *_a_value(option.options)]
    args = up.build_parser().parse_args(["--model", "m", *tokens])
    assert up.stage_flags(vars(args)) == {option.stage: tokens}
    stage = parse_args(options_module(option.stage).build_parser(), ["--model", "m", *tokens], {})
    assert getattr(stage, option.dest) == getattr(args, option.dest)
    # Left out, it is not passed at all: the compose file's environment decides.
    assert up.stage_flags(vars(up.build_parser().parse_args(["--model", "m"]))) == {}


def test_the_orchestrator_takes_one_optional_endpoint_flag_per_stage_kind() -> None:
    declared = declared_options("orchestrator")
    for name in STAGES:
        assert not declared[f"--{name}"].options.get("required"), name
    args = parse_args(options_module("orchestrator").build_parser(), ["--dit", "dit:1"], {})
    assert {name: getattr(args, name.replace("-", "_")) for name in STAGES} == {
        "text-encoder": None, "dit": "dit:1", "vae": None, "interp": None
    }  # fmt: skip


def _env_files(service: dict) -> list[str]:
    env_file = service.get("env_file") or []
    return [env_file] if isinstance(env_file, str) else list(env_file)


def test_every_variable_of_the_deploy_files_is_an_option_of_each_service_that_reads_it() -> None:
    """The env files (their settings and the examples in their comments) and the `environment` of every
    compose file: each STAGEDIFF_* name is an option of every service the file reaches."""
    readers: dict[Path, set[str]] = {}
    variables: dict[str, set[str]] = {}  # serve target -> the variables its services get
    for file in [*COMPOSE_FILES, TWO_MODELS_COMPOSE_FILE]:
        services = load_compose(file, {})
        target_of = {name: service.command[1] for name, service in services.items()}
        for name, service in services.items():
            variables.setdefault(target_of[name], set()).update(service.environment)
        for name, body in (yaml.safe_load(file.read_text())["services"]).items():
            for env_file in _env_files(body):
                readers.setdefault((file.parent / env_file).resolve(), set()).add(target_of[name])
        for override in OVERRIDES if file in COMPOSE_FILES else []:
            for name, body in (yaml.safe_load(override.read_text())["services"]).items():
                variables.setdefault(target_of[name], set()).update(body.get("environment") or {})
    for body in (yaml.safe_load(HA_COMPOSE_FILE.read_text())["services"]).values():
        if body.get("command", [None])[0] == "serve":
            for env_file in _env_files(body):
                readers.setdefault((DEPLOY / env_file).resolve(), set()).add(body["command"][1])
    assert set(readers) == {path.resolve() for path in (DEPLOY / "env").glob("*.env")}, "an env file no one reads"
    for env_file, targets in readers.items():
        for variable in _SETTING.findall(env_file.read_text()):
            for target in targets:
                variables.setdefault(target, set()).add(variable)
    for target, names in variables.items():
        options = {declaration.variable for declaration in declared_options(target).values()}
        unknown = sorted(name for name in names if name.startswith("STAGEDIFF_") and name not in options | NOT_OPTIONS)
        assert not unknown, f"stagediff serve {target} has no option for {unknown}"
