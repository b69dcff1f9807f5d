"""Options of every `stagediff serve`: from the command line, the environment and a config file.

Each option has one name and three sources, with one precedence: the command line, then the
environment, then the YAML file of `--config FILE`, then the option's default. `--ulysses-degree 4` is
`STAGEDIFF_ULYSSES_DEGREE=4` in the environment (the option's first long name, upper-cased, dashes to
underscores, behind `STAGEDIFF_`) and `ulysses-degree: 4` in the config file. That is how
deploy/docker-compose.yml keeps each stage's flags in an environment file (`env_file: env/dit.env`) and
Kubernetes in a ConfigMap, instead of in the command.

Switches (`--use-hsdp`) take true/yes/on/1 or false/no/off/0; an option that takes several values takes a
YAML list in the config file and `[a, b]` in the environment. A bad value is refused naming where it came
from (the variable, or the config file and its key). A `STAGEDIFF_*` variable that names no option of the
service is only warned about: one environment file may serve several services. `--config` itself is read
from the command line only.

The sources and their precedence come from ConfigArgParse (argparse with the environment and config files
added), so every service declares its options once, as plain argparse arguments in its own `options.py`, which
imports neither torch nor the stage's compute (pydantic-settings would declare each a second time, as a field).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import configargparse

from services.stage_table import SERVE_TARGETS

logger = logging.getLogger(__name__)

ENV_PREFIX = "STAGEDIFF_"
CONFIG_OPTION = "--config"
# Variables read directly by the code, not options: never warned about.
NOT_OPTIONS = frozenset({"STAGEDIFF_CLUSTER_SECRET", "STAGEDIFF_API_KEY", "STAGEDIFF_LAUNCH_ID"})
# ConfigArgParse's names for where a value came from (get_source_to_settings_dict).
_TAKEN_AS_GIVEN = ("command_line", "defaults")
_ENVIRONMENT_SOURCE = "environment_variables"


def environment_variable(option: str) -> str:
    """`--ulysses-degree` (or its dest, `ulysses_degree`) -> `STAGEDIFF_ULYSSES_DEGREE`."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


class OptionParser(configargparse.ArgumentParser):
    """The parser of a `stagediff serve` command: argparse, plus the environment and `--config FILE`."""

    def __init__(self, prog: str, description: str | None = None) -> None:
        super().__init__(
            prog=prog,
            description=description,
            # Exact names only: a misspelt config key must not pass as the option it abbreviates.
            allow_abbrev=False,
            epilog=f"Every option can also be set in the environment (--some-option as {ENV_PREFIX}SOME_OPTION) "
            f"or in the {CONFIG_OPTION} file (some-option: VALUE); the command line wins, then the environment.",
            auto_env_var_prefix=ENV_PREFIX,
            add_env_var_help=False,
            add_config_file_help=False,
            config_file_parser_class=configargparse.YAMLConfigFileParser,
            args_for_setting_config_path=[CONFIG_OPTION],
            config_arg_help_message="YAML file of options (`ulysses-degree: 4`, `use-hsdp: true`); "
            "the environment and the command line override it",
        )

    def error(self, message: str) -> None:
        """Exits with `message`, naming the variable or config file key when the bad value came from one."""
        for source, settings in self.get_source_to_settings_dict().items():
            if source in _TAKEN_AS_GIVEN:
                continue
            for key, (action, value) in settings.items():
                if action is not None and message.startswith(f"argument {'/'.join(action.option_strings)}:"):
                    where = key if source == _ENVIRONMENT_SOURCE else f"{source.partition('|')[2]}: {key}"
                    message = f"{where}={value!r}: {message}"
                    break
        super().error(message)


def parse_args(
    parser: OptionParser, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """The options of `argv` (default: sys.argv), `environ` (default: os.environ) and the --config file,
    in that precedence; warns about STAGEDIFF_* variables that name no option."""
    environ = os.environ if environ is None else environ
    args = parser.parse_args(args=argv, env_vars=environ)
    # Every option's variable follows its dest (no option renames its dest: tests/unit/test_options_declared_once.py).
    known = {environment_variable(dest) for dest in vars(args)} - {environment_variable(CONFIG_OPTION)}
    unknown = sorted(
        name for name in environ if name.startswith(ENV_PREFIX) and name not in known and name not in NOT_OPTIONS
    )
    if unknown:
        logger.warning("ignoring environment variables that name no option of %s: %s", parser.prog, ", ".join(unknown))
    return args


# -- what each service declares ------------------------------------------------------------------------------------


def options_module(target: str) -> ModuleType:
    """The module declaring the options of `stagediff serve <target>`: `options` beside the target's service
    module (dit_svc.service -> dit_svc.options), with `add_arguments(parser)` and `build_parser()`."""
    try:
        service_module = SERVE_TARGETS[target]
    except KeyError:
        raise ValueError(f"'{target}' is not a serve target; targets: {', '.join(SERVE_TARGETS)}") from None
    return importlib.import_module(service_module.rpartition(".")[0] + ".options")


@dataclass(frozen=True)
class Declaration:
    """One option as a service declares it: its names (the first long one is canonical) and add_argument's
    keyword arguments."""

    names: tuple[str, ...]
    options: Mapping[str, Any]

    @property
    def flag(self) -> str:
        return next(name for name in self.names if name.startswith("--"))

    @property
    def variable(self) -> str:
        return environment_variable(self.flag)


class _Recorder:
    """Stands in for a parser and keeps each add_argument call, groups flattened."""

    def __init__(self) -> None:
        self.declared: list[Declaration] = []

    def add_argument(self, *names: str, **options: Any) -> None:
        self.declared.append(Declaration(names, options))

    def add_argument_group(self, *args: Any, **kwargs: Any) -> _Recorder:
        return self


def declarations(add_arguments: Callable[[Any], None]) -> list[Declaration]:
    """The options a declaring function adds to a parser, in order."""
    recorder = _Recorder()
    add_arguments(recorder)
    return recorder.declared


def declared_options(target: str) -> dict[str, Declaration]:
    """Every option of `stagediff serve <target>` by each of its names."""
    declared = declarations(options_module(target).add_arguments)
    return {name: declaration for declaration in declared for name in declaration.names}
