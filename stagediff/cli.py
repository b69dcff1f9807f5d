"""The `stagediff` command line: init-model, up, serve, generate, health, info."""

from __future__ import annotations

import argparse
import logging
import sys

SERVE_TARGETS = {
    "orchestrator": "services.orchestrator.service",
    "text-encoder": "text_encoder_svc.service",
    "dit": "dit_svc.service",
    "vae": "vae_svc.service",
    "interp": "interp_svc.service",
}


def _serve(argv: list[str]) -> int:
    if not argv or argv[0] not in SERVE_TARGETS:
        print(f"usage: stagediff serve {{{','.join(SERVE_TARGETS)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    importlib.import_module(SERVE_TARGETS[argv[0]]).main(argv[1:])
    return 0


def _init_model(args: argparse.Namespace) -> int:
    from stagediff.init_model import init_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = init_model(args.family, args.preset, args.out, seed=args.seed)
    print(path)
    return 0


def _add_init_model_parser(commands: argparse._SubParsersAction) -> None:
    from stagediff.init_model import FAMILIES, PRESETS

    parser = commands.add_parser("init-model", help="write a random-weight checkpoint with the real classes")
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--preset", required=True, choices=PRESETS)
    parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_init_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagediff", description="Serve diffusion models as gRPC stage services.")
    commands = parser.add_subparsers(dest="command", required=True)

    from stagediff import client_cli, local_cluster

    _add_init_model_parser(commands)
    local_cluster.add_parser(commands)
    commands.add_parser("serve", help="run one service: " + ", ".join(SERVE_TARGETS), add_help=False)
    client_cli.add_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `serve` hands every remaining option to the service's own parser.
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
