"""The `stagediff` command line: init-model, up, serve, calibrate-cache, tenants; generate, submit, wait, jobs, cancel,
delete, models, health, info.

The client commands (stagediff/client_cli.py: generate, submit, wait, jobs, cancel, delete, models, health, info)
and `--help` load the client alone. The server commands (init-model, up, serve, calibrate-cache, tenants) are
declared here by name and help only; each imports its module, which brings torch and the server packages, and
parses its own options once it is chosen. `up` parses its options first (stagediff/up_options.py, on the client's
side), so `stagediff up --help` reads the same from any install. Where the servers (the distribution
stagediff-server) are not installed, a server command says in one line how to install them (exit code 2).

A client command ends quietly when its output's reader goes away (`stagediff info | head`: exit 141, as a
command killed by SIGPIPE) and when Ctrl-C ends it (exit 130; a command following a job cancels it first and
says so in one line).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from stagediff import client_cli, cluster_registry
from stagediff.protocol import INTERRUPTED


def _serve(argv: list[str]) -> int:
    # The orchestrator and every stage kind of services/stage_table.py (a server command: loaded when run).
    from services.stage_table import SERVE_TARGETS
    from services.supervised import watch_supervisor

    watch_supervisor()  # started by `stagediff up`: end with it

    if not argv or argv[0] not in SERVE_TARGETS:
        print(f"usage: stagediff serve {{{','.join(SERVE_TARGETS)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    importlib.import_module(SERVE_TARGETS[argv[0]]).main(argv[1:])
    return 0


def _up(argv: list[str]) -> int:
    from stagediff.up_options import build_parser

    args = build_parser().parse_args(argv)  # --help and mistaken options are answered without the servers
    from stagediff.local.up import run

    return run(args)


def _init_model(argv: list[str]) -> int:
    import logging

    from families.gguf import WRITABLE_TYPES, convert_checkpoint, original_names
    from families.init_model import ALL_PRESETS, PRESETS, init_model
    from families.registry import FAMILIES, FAMILY_NAMES
    from services.model_source import resolve_configs

    trained = "; ".join(
        f"{preset}: trained weights for {family.name}"
        for family in FAMILIES.values()
        for preset in family.trained_presets
    )
    own = "; ".join(
        f"{preset}: {description} ({family.name})"
        for family in FAMILIES.values()
        for preset, description in family.own_presets.items()
    )
    parser = argparse.ArgumentParser(
        prog="stagediff init-model",
        description="Writes a random-weight diffusers checkpoint with the real classes, config keys and a tokenizer, "
        "or copies a trained one.",
    )
    parser.add_argument("--family", required=True, choices=FAMILY_NAMES)
    parser.add_argument(
        "--preset",
        required=True,
        choices=ALL_PRESETS,
        help=f"{', '.join(PRESETS)}: random weights for every family; {own}; {trained}",
    )
    parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--config-from",
        metavar="DIR|ORG/NAME[@REVISION]",
        default=None,
        help="for a *-config preset: the components' configs of this checkpoint directory or Hugging Face Hub id "
        "(only its configs are fetched), in place of the preset's own",
    )
    parser.add_argument(
        "--gguf",
        choices=WRITABLE_TYPES,
        default=None,
        help="write the transformer(s) as one GGUF file of this type each, in place of their safetensors "
        "(the layout published GGUF files have: the blocks' linear weights quantized, the rest float32)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.gguf:
            original_names(FAMILIES[args.family])  # refuses a family with no GGUF layout before writing anything
        config_from = None if args.config_from is None else resolve_configs(args.config_from)
        out = init_model(args.family, args.preset, args.out, seed=args.seed, config_from=config_from)
        if args.gguf:
            convert_checkpoint(out, FAMILIES[args.family], args.gguf)
        print(out)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _calibrate_cache(argv: list[str]) -> int:
    from tools.calibrate import main as calibrate

    return calibrate(argv)


def _tenants(argv: list[str]) -> int:
    from services.orchestrator.tenants.cli import main as tenants

    return tenants(argv, prog="stagediff tenants")


# How to install the servers, for a server command run where they are not installed.
INSTALL_SERVERS = "from a checkout, pip install . ./server; from wheels, make wheel, then pip install dist/*.whl"

# name -> (help, handler of the arguments after the name)
SERVER_COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "init-model": ("write a random-weight checkpoint with the real classes, or copy a trained one", _init_model),
    "up": ("run the docker-compose topology as local processes", _up),
    "serve": ("run one service: the orchestrator or a stage (`stagediff serve` lists them)", _serve),
    "calibrate-cache": ("measure MagCache's ratios for a checkpoint (written into it)", _calibrate_cache),
    "tenants": ("tenants files and API keys: new-key, list FILE, check FILE", _tenants),
}
# The exit code of a command whose output's reader went away (128 + SIGPIPE, as a shell reports it).
BROKEN_PIPE = 141


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagediff", description="Serve diffusion models as gRPC stage services.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=client_cli.CommandParser)
    for name, (help_text, _) in SERVER_COMMANDS.items():
        # Listed for --help only: main() hands these commands their arguments before this parser sees them.
        commands.add_parser(name, help=help_text, add_help=False)
    client_cli.add_parsers(commands)
    cluster_registry.add_parsers(commands)  # ps, down: the clusters `up` runs on this machine
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVER_COMMANDS:
        try:
            return SERVER_COMMANDS[argv[0]][1](argv[1:])
        except ModuleNotFoundError as error:
            # The plain install is the client alone; the server commands need the servers' distribution.
            print(
                f"stagediff {argv[0]} needs the servers, which are not installed here ({error}): {INSTALL_SERVERS}",
                file=sys.stderr,
            )
            return 2
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
    except BrokenPipeError:
        # Whatever is left to print goes nowhere, the interpreter's own flush at exit included.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except KeyboardInterrupt:
        return INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
