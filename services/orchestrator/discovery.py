"""Where each stage's replicas are: the sources its flag names, looked up again every probe interval.

A stage's flag (`--dit`) is a comma-separated list of sources:
- `HOST:PORT`: one replica, always listed;
- `dns:NAME:PORT`: every address NAME resolves to, at PORT, looked up again every probe interval (a headless
  Service on Kubernetes answers with one address per ready pod). gRPC's own `dns:///` resolver looks again only
  after a connection fails, so a replica added to a healthy pool would go unseen.

`StagePool` (stage_clients.py) reconciles each stage with what its sources say: a new endpoint joins once a
probe finds it SERVING; one no longer listed takes no new call, and its channel is closed once its calls in
flight have ended. A lookup that fails leaves the stage as it was. A stage lists at most
`MAX_REPLICAS_PER_STAGE` endpoints, whatever a name resolves to. Over TLS (`--stage-tls-ca`) an address found
under NAME is dialled as NAME, which the stages' certificate must list.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DNS_PREFIX = "dns:"
MAX_REPLICAS_PER_STAGE = 256

# (name, port) -> the addresses the name has now; raises OSError when the lookup fails.
Lookup = Callable[[str, int], list[str]]


def system_lookup(name: str, port: int) -> list[str]:
    """The addresses `name` resolves to (the system resolver: /etc/hosts, DNS)."""
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)})


def endpoint_of(address: str, port: int) -> str:
    """HOST:PORT, with an IPv6 address in brackets."""
    try:
        bracketed = ipaddress.ip_address(address).version == 6
    except ValueError:
        bracketed = False
    return f"[{address}]:{port}" if bracketed else f"{address}:{port}"


@dataclass(frozen=True)
class StageSources:
    """A stage's flag, parsed: the endpoints it lists and the names it looks up."""

    flag: str
    endpoints: tuple[str, ...]
    names: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, stage: str, value: str | Sequence[str]) -> StageSources:
        """ValueError naming the stage's flag and the source it cannot read."""
        parts = value.split(",") if isinstance(value, str) else [part for item in value for part in item.split(",")]
        sources = [part.strip() for part in parts if part.strip()]
        endpoints: list[str] = []
        names: list[tuple[str, int]] = []
        for source in sources:
            if source.startswith(DNS_PREFIX):
                name, _, port = source.removeprefix(DNS_PREFIX).rpartition(":")
                if not name or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ValueError(f"--{stage} {source}: write a looked-up name as dns:NAME:PORT")
                names.append((name, int(port)))
            else:
                endpoints.append(source)
        return cls(",".join(sources), tuple(endpoints), tuple(names))

    async def resolve(self, lookup: Lookup) -> dict[str, str | None]:
        """{endpoint: the name it was looked up from, None for a listed one} of what the sources name now,
        listed ones first; OSError when a lookup fails. Over TLS a looked-up address is verified as its name."""
        found: dict[str, str | None] = dict.fromkeys(self.endpoints)
        for name, port in self.names:
            for address in await asyncio.to_thread(lookup, name, port):
                found.setdefault(endpoint_of(address, port), name)
        return dict(list(found.items())[:MAX_REPLICAS_PER_STAGE])
