"""`stagediff up`'s options, declared on the client's side (stagediff/up_options.py): the values it repeats from
the servers are theirs, and its help says what each option does by default and names only options it has.

That each stage option is its stage's own is tests/unit/test_options_declared_once.py's; that `up --help` runs
where the servers are not installed, tests/integration/test_install_processes.py's.
"""

from __future__ import annotations

import argparse
import re

from services.gateway.options import DEFAULT_PORT as GATEWAY_PORT
from services.orchestrator.options import DEFAULT_PORT as ORCHESTRATOR_PORT
from services.orchestrator.options import DEFAULT_STATE_DIR
from services.orchestrator.options import build_parser as orchestrator_parser
from stagediff import up_options
from stagediff.local.compose import DEFAULT_COMPOSE_FILE
from stagediff.up_options import STAGE_OPTIONS, build_parser


def _own_options() -> list[argparse.Action]:
    """`up`'s own options: not --help, not the stage options it passes on."""
    stage_flags = {name for option in STAGE_OPTIONS for name in option.names}
    return [
        action
        for action in build_parser()._actions
        if action.option_strings and not set(action.option_strings) & ({"-h", "--help"} | stage_flags)
    ]


def test_the_values_up_repeats_are_the_servers() -> None:
    assert up_options.DEFAULT_PORT == ORCHESTRATOR_PORT
    assert up_options.DEFAULT_HTTP_PORT == GATEWAY_PORT
    assert up_options.DEFAULT_STATE_DIR == DEFAULT_STATE_DIR
    assert DEFAULT_COMPOSE_FILE.name == up_options.DEFAULT_COMPOSE_FILE_NAME and DEFAULT_COMPOSE_FILE.is_file()
    host = next(action for action in orchestrator_parser()._actions if "--host" in action.option_strings)
    assert host.default == up_options.DEFAULT_HOST


def test_every_option_of_up_says_its_default() -> None:
    """A switch is off unless given, and --model must be given; every other option says what happens without it
    (--port, --host, --startup-timeout and --threads-per-stage once hid theirs)."""
    unsaid = [
        action.option_strings[-1]
        for action in _own_options()
        if not isinstance(action, argparse._StoreTrueAction) and not action.required and "default" not in action.help
    ]
    assert unsaid == []
    text = " ".join(build_parser().format_help().split())
    for shown in ("(default: 50051; 0: a free port)", "(default: 127.0.0.1)", "(default: 600.0)", "(default: torch's"):
        assert shown in text


def test_the_help_names_only_options_up_has_and_no_container_path() -> None:
    parser = build_parser()
    groups = [group.description or "" for group in parser._action_groups]
    text = " ".join([parser.description or "", *groups, *(action.help or "" for action in parser._actions)])
    options = {name for action in parser._actions for name in action.option_strings}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert named - options == set(), "the help names options `up` does not have"
    assert "/models/model" not in text, "the model is a directory on this machine, not a container's mount"
