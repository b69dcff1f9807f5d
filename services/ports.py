"""Whether a server's TCP port can be bound, asked before it binds so that a taken port is refused in one line.

Every StageDiff server binds its port exclusively: gRPC servers without SO_REUSEPORT (`grpc.so_reuseport` 0 in
services/server.py), the HTTP gateway as asyncio does by default. Two servers can then never share a port and
split its callers between them; the second one to start must fail, naming the port and the flag that set it.
The probe binds the same addresses the server would, with SO_REUSEADDR as gRPC and uvicorn set it (so a port
whose old connections linger in TIME_WAIT counts as free), and closes at once.
"""

from __future__ import annotations

import errno
import socket


def bind_problem(host: str, port: int, flag: str) -> str | None:
    """Why `host:port` cannot be bound now, in one line naming the port and `flag`; None when it can (port 0,
    a free port the kernel picks, always can)."""
    if port == 0:
        return None
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        return f"port {port} ({flag}) cannot be bound: host {host!r} does not resolve ({error.strerror})"
    for family, kind, protocol, _, address in addresses:
        try:
            with socket.socket(family, kind, protocol) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
        except OSError as error:
            return _message(port, flag, host, error)
    return None


def _message(port: int, flag: str, host: str, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return f"port {port} is already in use ({flag}): another process listens there; stop it, or choose another port"
    return f"port {port} ({flag}) cannot be bound on {host}: {error.strerror or error}"
