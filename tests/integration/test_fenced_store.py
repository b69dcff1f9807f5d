"""Two orchestrators' stores on one PostgreSQL database and one S3 bucket (real servers): a replica that lost
its job's lease writes nothing the new owner's rows name, and a result reaches the bucket part by part while
it is written, visible only once committed and never after an abort; a database restart costs one call."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.orchestrator.blobs import S3Blobs, s3_client
from services.orchestrator.blobs import s3 as s3_module
from services.orchestrator.store import JobRecord, JobStore, LeaseLost
from services.orchestrator.store.leases import JobLeases
from services.orchestrator.store_errors import StoreUnavailable
from stagediff.local.servers import Postgres, S3Server, postgres
from stagediff.tensor_codec import encode_tensor
from stagediff.v1 import generation_pb2
from tests.helpers.store import FAILED, QUEUED, RUNNING, SUCCEEDED, files


def _blobs(s3: S3Server, prefix: str) -> S3Blobs:
    client = s3_client(s3.endpoint, s3.access_key, s3.secret_key, checksums="when_required")
    return S3Blobs(client, s3.bucket, prefix=f"{prefix}/")


@pytest.fixture
def stores(tmp_path: Path, postgres_server: Postgres, s3_server: S3Server):
    url, blobs = postgres_server.new_database(), _blobs(s3_server, tmp_path.name)
    with (
        JobStore.open(tmp_path / "a", database_url=url, blobs=blobs, owner="replica-a", lease_ttl_s=0.0) as a,
        JobStore.open(tmp_path / "b", database_url=url, blobs=blobs, owner="replica-b") as b,
    ):
        yield a, b


def _frames(count: int, value: int) -> np.ndarray:
    return np.full((count, 8, 16, 3), value, np.uint8)


def test_a_replica_that_lost_its_lease_changes_nothing(stores: tuple[JobStore, JobStore]) -> None:
    a, b = stores
    request = generation_pb2.GenerateRequest(model="tiny", prompt="p", height=8, width=16, num_frames=2)
    a.insert(JobRecord.new("j", "acme", request))
    assert a.update_state("j", RUNNING).lease_epoch == 1
    a.mark_stage_done("j", "text-encoder", list(encode_tensor("prompt_embeds", np.ones(4, np.float32))))
    stale = a.create_result("j", (2, 8, 16, 3))
    stale.write(0, 0, _frames(2, 1).reshape(-1))
    stale.add_piece(0, 2)
    # a stops (a SIGSTOP, a partition) past its lease: the leader requeues the job and b claims it.
    assert JobLeases(b._db, "leader").requeue_expired() == ["j"]
    assert b.get("j").state == QUEUED
    assert b.update_state("j", RUNNING).lease_epoch == 2
    # a wakes up: its lease keeper finds the lease lost (its run is stopped), and until that run ends every
    # write it makes under epoch 1 is refused, and the blob it uploaded is dropped.
    assert a.renew_claims() == {"j"} and a.claimed() == {"j": 1}
    assert not a.mark_stage_done("j", "dit", list(encode_tensor("latents", np.ones(4, np.float32))))
    with pytest.raises(LeaseLost, match="epoch 1"):
        a.commit_result(stale, 16.0)
    with pytest.raises(LeaseLost):
        a.update_state("j", FAILED, error_code=13)
    a.forget_claim("j")  # the run there ended (Dispatcher, JobManager.lose)
    assert a.renew_claims() == set() and a.claimed() == {}
    assert list(b.load_intermediates("j")) == ["text-encoder"]  # what the former owner finished still counts
    b.save_result("j", _frames(2, 2), 16.0)
    record, result = b.get("j"), b.load_result("j")
    assert (record.state, record.attempts, record.owner) == (SUCCEEDED, 2, "replica-b")
    assert np.array_equal(result.frames, _frames(2, 2))
    assert files(b) == ["j/result-frames.npy"]  # exactly one result: epoch 2's
    # A blob no row names (a crash between upload and commit) goes once old enough, and only it.
    assert b.files.blobs is not None
    b.files.blobs.put("ghost/e1/result-frames.npy", b"x")
    assert b.collect_garbage() == 0  # young: perhaps a live replica's, about to be committed
    assert b.collect_garbage(min_age_s=-1) == 1 and files(b) == ["j/result-frames.npy"]


def test_a_result_streams_to_the_bucket_and_appears_only_when_committed(
    stores: tuple[JobStore, JobStore], monkeypatch: pytest.MonkeyPatch, s3_server: S3Server
) -> None:
    _, b = stores
    monkeypatch.setattr(s3_module, "PART_BYTES", 5 << 20)
    blobs = b.files.blobs
    assert isinstance(blobs, S3Blobs)
    request = generation_pb2.GenerateRequest(model="tiny", prompt="p", height=256, width=256, num_frames=40)
    for job_id in ("kept", "cancelled"):
        b.insert(JobRecord.new(job_id, "acme", request))
        b.update_state(job_id, RUNNING)
    frames = np.random.default_rng(0).integers(0, 255, (40, 256, 256, 3), np.uint8)  # 7.5 MiB
    writers = {job_id: b.create_result(job_id, frames.shape) for job_id in ("kept", "cancelled")}
    for writer in writers.values():
        for first in range(0, 40, 10):
            writer.write(first, 0, frames[first : first + 10].reshape(-1))
            writer.add_piece(first, 10)
    # A part is in the bucket already, in an upload nothing can read yet.
    assert sorted(key.split("/")[0] for key in blobs.open_uploads()) == ["cancelled", "kept"]
    assert list(blobs.keys("")) == []
    writers["cancelled"].discard()
    b.update_state("cancelled", FAILED, error_code=1)
    b.commit_result(writers["kept"], 16.0)
    assert blobs.open_uploads() == [] and files(b) == ["kept/result-frames.npy"]
    assert np.array_equal(b.load_result("kept").frames, frames)
    with b.load_result("kept").open() as reader:  # ranged reads of the committed object
        assert np.array_equal(reader.frames(39, 1), frames[39:])
    b.delete("kept")
    assert files(b) == []


def test_a_database_restart_breaks_one_call_and_the_next_reconnects(tmp_path: Path) -> None:
    """A call during the outage raises StoreUnavailable (what the orchestrator retries, or answers UNAVAILABLE);
    the next one opens a new connection and finds every committed row."""
    with postgres() as server, JobStore.open(tmp_path, database_url=server.dsn) as store:
        request = generation_pb2.GenerateRequest(model="tiny", prompt="p", height=8, width=16, num_frames=2)
        store.insert(JobRecord.new("j", "acme", request))
        server.restart()
        with pytest.raises(StoreUnavailable, match="cannot be reached"):
            store.get("j")
        assert store.get("j").state == QUEUED
        assert store.update_state("j", RUNNING).attempts == 1
