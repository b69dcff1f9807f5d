"""The BlobStore rules (services/orchestrator/blobs/protocol.py) against each implementation: the local
directory, and S3 on a real SeaweedFS server started for the session."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.orchestrator.blobs import BlobError, BlobNotFound, BlobStore, LocalBlobs, S3Blobs, s3_client
from services.orchestrator.blobs import s3 as s3_module
from stagediff.local.servers import S3Server


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "local":
        return LocalBlobs(tmp_path / "blobs")
    server: S3Server = request.getfixturevalue("s3_server")
    client = s3_client(server.endpoint, server.access_key, server.secret_key, checksums="when_required")
    return S3Blobs(client, server.bucket, prefix=f"{tmp_path.name}/")


def test_each_implementation_is_a_blob_store(store: BlobStore) -> None:
    assert isinstance(store, BlobStore)


def test_put_get_range_size_and_delete(store: BlobStore) -> None:
    store.put("tenants/a/jobs/1/result.bin", b"0123456789")
    assert store.get("tenants/a/jobs/1/result.bin") == b"0123456789"
    assert store.size("tenants/a/jobs/1/result.bin") == 10
    assert store.get_range("tenants/a/jobs/1/result.bin", 2, 5) == b"234"
    assert store.get_range("tenants/a/jobs/1/result.bin", 10, 10) == b""
    with pytest.raises(BlobError, match=r"range \[4, 11\)"):
        store.get_range("tenants/a/jobs/1/result.bin", 4, 11)
    store.delete("tenants/a/jobs/1/result.bin")
    store.delete("tenants/a/jobs/1/result.bin")  # deleting a missing blob is no error
    assert store.size("tenants/a/jobs/1/result.bin") is None
    with pytest.raises(BlobNotFound):
        store.get("tenants/a/jobs/1/result.bin")


def test_a_writer_publishes_on_commit_and_an_abort_leaves_nothing(
    store: BlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_module, "PART_BYTES", 5 << 20)  # S3's least part size: three parts here
    data = bytes(range(256)) * (48 << 10)  # 12 MiB
    writer = store.writer("jobs/1/frames.raw")
    for start in range(0, len(data), 1 << 20):
        writer.write(data[start : start + (1 << 20)])
    assert store.size("jobs/1/frames.raw") is None and list(store.keys("jobs/")) == []
    assert writer.commit() == len(data)
    assert store.get("jobs/1/frames.raw") == data
    assert store.get_range("jobs/1/frames.raw", (5 << 20) - 3, (5 << 20) + 3) == data[(5 << 20) - 3 : (5 << 20) + 3]

    aborted = store.writer("jobs/2/frames.raw")
    aborted.write(data)
    aborted.abort()
    aborted.abort()
    assert store.size("jobs/2/frames.raw") is None
    assert sorted(store.keys("jobs/")) == ["jobs/1/frames.raw"]
    if isinstance(store, S3Blobs):
        assert store.open_uploads() == []


def test_keys_and_delete_prefix_name_whole_segments(store: BlobStore) -> None:
    for key in ("t/a/1", "t/a/2", "t/ab/1", "t/b/1"):
        store.put(key, key.encode())
    assert sorted(store.keys("t/a/")) == ["t/a/1", "t/a/2"]
    assert store.delete_prefix("t/a/") == 2
    assert sorted(store.keys("t/")) == ["t/ab/1", "t/b/1"]


@pytest.mark.parametrize("key", ["", "a//b", "../x", "a/./b", "a b", "a/", "x" * 1025])
def test_bad_keys_are_refused_naming_the_rule(store: BlobStore, key: str) -> None:
    with pytest.raises(ValueError, match="blob key"):
        store.put(key, b"x")
