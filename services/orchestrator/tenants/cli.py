"""`stagediff tenants` (also `python -m services.orchestrator.tenants`): the operator's commands for tenants files
and API keys.

`new-key` makes a key and prints it once with its hash; `hash-key` hashes a key read from stdin; `list FILE`
prints a tenants file's tenants as a table; `check FILE` validates a tenants file, printing each problem on its
own line with the field's path (exit 1 when there is one). A key is printed once and stored nowhere: the file
holds only its hash.
"""

from __future__ import annotations

import argparse
import sys

from services.orchestrator.tenants.keys import hash_api_key, new_api_key
from services.orchestrator.tenants.registry import TenantRegistry
from services.orchestrator.tenants.schema import Quotas, Tenant, TenantConfigError

PROG = "python -m services.orchestrator.tenants"
DESCRIPTION = "Tenants of the public API: who may call, how they are ranked, and how much they may ask for."


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """`new-key` makes a key and prints it once with its hash; `hash-key` hashes a key read from stdin;
    `list FILE` prints the tenants of a file; `check FILE` validates a tenants file."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("new-key", help="make an API key; prints the key (once) and the hash for the tenants file")
    commands.add_parser("hash-key", help="print the hash of a key read from standard input")
    listing = commands.add_parser("list", help="the tenants of a tenants file: admin, keys, models and quotas")
    listing.add_argument("file")
    check = commands.add_parser("check", help="validate a tenants file; print each problem with its field's path")
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
        for problem in error.problems:
            print(problem, file=sys.stderr)
        return 1
    if command == "list":
        print_table([tenant_row(tenant) for tenant in registry.tenants.values()])
        return 0
    print(f"{file}: {len(registry.tenants)} tenant(s): {', '.join(registry.tenants)}")
    return 0


TABLE_HEADER = ("NAME", "PRIORITY", "ADMIN", "KEYS", "MODELS", "QUOTAS")


def tenant_row(tenant: Tenant) -> tuple[str, ...]:
    """A tenant as `list` shows it: name, priority, admin, its number of keys, its models, its quotas."""
    quotas = _quotas_text(tenant.quotas)
    for model, model_quotas in tenant.model_quotas.items():
        quotas += f" [{model}: {_quotas_text(model_quotas)}]"
    return (
        tenant.name,
        tenant.priority.value,
        "yes" if tenant.admin else "no",
        str(len(tenant.api_keys)),
        ",".join(tenant.models) or "all",
        quotas.strip() or "defaults",
    )


def _quotas_text(quotas: Quotas) -> str:
    """The quotas the file sets, as `name=value` (those left at their defaults are not repeated)."""
    return " ".join(f"{name}={getattr(quotas, name)}" for name in sorted(quotas.model_fields_set))


def print_table(rows: list[tuple[str, ...]]) -> None:
    """The rows under TABLE_HEADER, in columns; the last column (the quotas) as long as it is."""
    table = [TABLE_HEADER, *rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(TABLE_HEADER) - 1)]
    for row in table:
        print("  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]]).rstrip())
