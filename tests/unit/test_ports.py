"""Ports are exclusive, and `stagediff up` reports ready only with services of its own.

A second server on a taken port fails at startup naming the port and its flag, while the first goes on
answering; `stagediff up` refuses taken ports and a state dir in use before it starts anything; and an answer
that lacks the launch id given to a process (another server on the port) never counts as that process ready.
"""

from __future__ import annotations

from stagediff.local.health import is_http_ready, is_serving
from stagediff.local.ownership import grpc_ready_as, http_ready_as
from tests.helpers.ports import foreign_grpc_server, foreign_readyz


def test_a_server_without_the_launch_id_given_is_never_taken_for_ready() -> None:
    """Another cluster's gateway or stage on the port answers ready, but not with the id of the process started."""
    with foreign_readyz() as url:
        assert is_http_ready(url), "any server on the port passes a plain readiness check"
        assert not http_ready_as(url, "mine", timeout=5.0)
    with foreign_readyz(launch_id="theirs") as url:
        assert not http_ready_as(url, "mine", timeout=5.0)
    with foreign_grpc_server() as endpoint:
        assert is_serving(endpoint)
        assert not grpc_ready_as(endpoint, "mine", timeout=5.0)
