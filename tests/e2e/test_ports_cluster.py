"""`stagediff up` reports ready only with services of its own: an answer that lacks the launch id given to a
process (another server on the port) never counts as that process ready."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagediff.local import supervisor
from stagediff.local.supervisor import LocalCluster
from tests.helpers.ports import STARTUP_TIMEOUT_S, foreign_readyz


@pytest.mark.e2e
def test_up_is_not_ready_while_another_server_answers_readyz_on_its_http_port(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port was free when checked and taken before the gateway bound it: the gateway exits, and the 200 that
    the other server answers on /readyz (without this gateway's launch id) does not make the cluster ready."""
    monkeypatch.setattr(supervisor, "startup_problems", lambda *args: [])  # taken after the check
    with foreign_readyz() as url:
        http_port = int(url.rsplit(":", 1)[1].split("/")[0])
        cluster = LocalCluster(tiny_model, http_port=http_port, threads_per_stage=1, log_dir=tmp_path / "logs")
        with pytest.raises(RuntimeError, match="gateway exited with code"):
            cluster.start(timeout=STARTUP_TIMEOUT_S * 3)
    assert f"port {http_port} is already in use (--port)" in (tmp_path / "logs" / "gateway.log").read_text()
