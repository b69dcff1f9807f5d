"""`python -m services.orchestrator.tenants`: the operator's commands for tenants files and API keys.

`new-key` makes a key and prints it once with its hash; `hash-key` hashes a key read from stdin; `check FILE`
validates a tenants file. A key is printed once and stored nowhere: the file holds only its hash.
"""

from __future__ import annotations

import argparse
import sys

from services.orchestrator.tenants.keys import hash_api_key, new_api_key
from services.orchestrator.tenants.registry import TenantRegistry
from services.orchestrator.tenants.schema import TenantConfigError

PROG = "python -m services.orchestrator.tenants"
DESCRIPTION = "Tenants of the public API: who may call, how they are ranked, and how much they may ask for."


def main(argv: list[str] | None = None) -> int:
    """`new-key` makes a key and prints it once with its hash; `hash-key` hashes a key read from stdin;
    `check FILE` validates a tenants file."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("new-key", help="make an API key; prints the key (once) and the hash for the tenants file")
    commands.add_parser("hash-key", help="print the hash of a key read from standard input")
    check = commands.add_parser("check", help="validate a tenants file")
    check.add_argument("file")
    args = parser.parse_args(argv)
    command: str = args.command

    if command == "new-key":
        key = new_api_key()
        print(f"key:  {key}")
        print(f"hash: {hash_api_key(key)}")
        print(
            "Give the key to the tenant; it is not stored anywhere. "
            "Add the hash to the tenant's api_keys in the tenants file.",
            file=sys.stderr,
        )
        return 0
    if command == "hash-key":
        key = sys.stdin.readline().strip()
        if not key:
            print("hash-key: no key on standard input", file=sys.stderr)
            return 2
        print(hash_api_key(key))
        return 0
    file: str = args.file
    try:
        registry = TenantRegistry.from_file(file)
    except TenantConfigError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{file}: {len(registry.tenants)} tenant(s): {', '.join(registry.tenants)}")
    return 0
