"""Every `stagediff serve` option can also come from the environment.

`--ulysses-degree 4` may be given as `STAGEDIFF_ULYSSES_DEGREE=4`: the option's
long name, upper-cased, dashes to underscores, behind `STAGEDIFF_`. That is
how deploy/docker-compose.yml keeps each stage's parallel and memory flags in
an environment file (`env_file: env/dit.env`) and Kubernetes in a ConfigMap,
instead of in the command. The command line wins over the environment.

Values are checked as the command line checks them, and a bad one is refused
naming the variable. Switches (`--use-hsdp`) take 1/true/yes/on or
0/false/no/off. Options that take several values (`--ignored-layers`) split
theirs on whitespace. A `STAGEDIFF_*` variable that names no option of this
service is only warned about: one environment file may serve several services.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

logger = logging.getLogger(__name__)

ENV_PREFIX = "STAGEDIFF_"
# Variables read directly by the code, not options: never warned about.
NOT_OPTIONS = frozenset({"STAGEDIFF_CLUSTER_SECRET", "STAGEDIFF_API_KEY"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def environment_variable(option: str) -> str:
    """`--ulysses-degree` -> `STAGEDIFF_ULYSSES_DEGREE`."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def _long_option(action: argparse.Action) -> str | None:
    """The first `--name` of an option (its canonical spelling); None for positionals and -h."""
    long_names = [name for name in action.option_strings if name.startswith("--")]
    if not long_names or isinstance(action, argparse._HelpAction):
        return None
    return long_names[0]


def _arguments_from_environment(
    parser: argparse.ArgumentParser, environ: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """Command-line tokens for the options set in `environ`, and the STAGEDIFF_* names that matched none."""
    tokens: list[str] = []
    used: set[str] = set()
    # argparse keeps its actions in a private list and offers no public way to walk them.
    for action in parser._actions:
        option = _long_option(action)
        if option is None:
            continue
        name = environment_variable(option)
        if name not in environ:
            continue
        used.add(name)
        value = environ[name].strip()
        if action.nargs == 0:  # a switch: store_true, store_false, store_const
            if value.lower() in _TRUE:
                tokens.append(option)
            elif value.lower() not in _FALSE:
                parser.error(f"{name}={environ[name]!r}: use 1, true, yes or on (or 0, false, no, off)")
            continue
        values = shlex.split(value) if action.nargs not in (None, argparse.OPTIONAL) else [value]
        for item in values:
            _check_value(parser, action, name, item)
        tokens += [option, *values]
    unknown = sorted(
        name for name in environ if name.startswith(ENV_PREFIX) and name not in used and name not in NOT_OPTIONS
    )
    return tokens, unknown


def _check_value(parser: argparse.ArgumentParser, action: argparse.Action, name: str, value: str) -> None:
    """Refuses a value the option would refuse, naming the variable rather than the option."""
    converted: object = value
    if action.type is not None and callable(action.type):
        try:
            converted = action.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
            kind = getattr(action.type, "__name__", "value")
            parser.error(f"{name}={value!r}: not a valid {kind} ({error})")
    if action.choices is not None and converted not in action.choices:
        allowed = ", ".join(str(choice) for choice in action.choices)
        parser.error(f"{name}={value!r}: choose from {allowed}")


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """`parser.parse_args(argv)` with every option defaulting to its STAGEDIFF_* environment variable."""
    environ = os.environ if environ is None else environ
    if parser.epilog is None:
        parser.epilog = f"Every option can also be set in the environment: --some-option as {ENV_PREFIX}SOME_OPTION."
    tokens, unknown = _arguments_from_environment(parser, environ)
    if unknown:
        logger.warning("ignoring environment variables that name no option of %s: %s", parser.prog, ", ".join(unknown))
    # The environment's options come first, so that the same option on the command line replaces them.
    return parser.parse_args([*tokens, *(sys.argv[1:] if argv is None else argv)])
