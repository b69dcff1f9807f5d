"""A job's input images are a file beside the job, counted in its tenant's bytes, never in its row or in memory."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import pytest

from services.orchestrator.admission import without_image_bytes
from services.orchestrator.store import INPUT_IMAGES, JobRecord, JobStore, StoreError
from stagediff.v1 import generation_pb2, image_pb2

PNG = b"\x89PNG\r\n\x1a\n" + bytes(3 << 20)


@contextlib.asynccontextmanager
async def held_jobs(state_dir: Path):
    """A JobManager on a store in `state_dir` whose jobs run until the block ends, one at a time; yields
    (manager, store, the open tenant)."""
    from services.orchestrator.jobs import JobManager
    from services.orchestrator.scheduler import FairScheduler
    from services.orchestrator.tenants import TenantRegistry

    release = asyncio.Event()

    async def run(job) -> None:
        await release.wait()

    with JobStore.open(state_dir) as store:
        manager = JobManager(run, FairScheduler(max_running=1), store)
        try:
            yield manager, store, TenantRegistry.open().authenticate(None)
        finally:
            release.set()
            await manager.shutdown()


def request_with_images() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt="a fox",
        images=[
            image_pb2.InputImage(data=PNG, role=image_pb2.IMAGE_ROLE_FIRST_FRAME, sha256="a" * 64, width=8, height=8),
            image_pb2.InputImage(data=b"second", role=image_pb2.IMAGE_ROLE_LAST_FRAME, sha256="b" * 64),
        ],
    )


@pytest.fixture
def store(tmp_path: Path):
    with JobStore.open(tmp_path / "state") as opened:
        yield opened


def insert(store: JobStore, job_id: str = "job1") -> generation_pb2.GenerateRequest:
    request = request_with_images()
    stored = without_image_bytes(request)
    store.insert(JobRecord.new(job_id, "acme", stored), store.save_input_images(job_id, request.images))
    return request


def test_the_images_are_a_file_the_row_holds_no_bytes_and_the_tenant_is_charged(store: JobStore) -> None:
    request = insert(store)
    row_bytes = sqlite3.connect(store.state_dir / "jobs.sqlite3").execute("SELECT length(request) FROM jobs").fetchone()
    assert row_bytes[0] < 1024
    parsed = store.get("job1").parse_request()
    assert [image.data for image in parsed.images] == [b"", b""]
    assert [image.sha256 for image in parsed.images] == ["a" * 64, "b" * 64]
    assert store.usage("acme").active >= len(PNG) + len(b"second")
    assert list(store.load_input_images("job1")) == list(request.images)
    # The stages' outputs, which a restarted job resumes from, do not include them.
    assert INPUT_IMAGES not in store.load_intermediates("job1")


def test_the_images_are_dropped_once_encoded_and_then_no_longer_counted(store: JobStore) -> None:
    insert(store)
    folder = store.jobs_dir / "job1"
    assert any(folder.iterdir())
    store.drop_input_images("job1")
    assert not any(folder.iterdir())
    assert store.usage("acme").active == 0
    with pytest.raises(StoreError, match="input images are no longer stored"):
        store.load_input_images("job1")


def test_a_finished_job_keeps_no_images(store: JobStore) -> None:
    insert(store)
    store.update_state("job1", generation_pb2.JOB_STATE_CANCELLED, error_code=1, error_message="cancelled")
    assert store.usage("acme").active == 0
    assert not (store.jobs_dir / "job1").exists() or not any((store.jobs_dir / "job1").iterdir())


def test_the_images_survive_a_reopen_of_the_store(tmp_path: Path) -> None:
    with JobStore.open(tmp_path / "state") as first:
        request = insert(first)
    with JobStore.open(tmp_path / "state") as second:  # the sweep keeps files a row names
        assert list(second.load_input_images("job1")) == list(request.images)


def test_a_job_that_cannot_be_stored_leaves_no_image_file(store: JobStore) -> None:
    insert(store)
    with pytest.raises(StoreError, match="already stored"):
        insert(store)  # the same job id
    assert list(store.load_input_images("job1"))  # the first job's images are still there
    refused = store.save_input_images("job9", request_with_images().images)
    store.discard_saved_images("job9", refused)  # refused by the queue after its images were written
    assert sorted(path.name for path in store.jobs_dir.iterdir()) == ["job1"]


def test_a_job_without_images_writes_no_file(store: JobStore) -> None:
    assert store.save_input_images("job2", []) is None
    store.insert(JobRecord.new("job2", "acme", generation_pb2.GenerateRequest(prompt="a fox")))
    assert not (store.jobs_dir / "job2").exists()


def test_saving_runs_off_the_loop(store: JobStore) -> None:
    request = request_with_images()

    async def main() -> None:
        saved = await asyncio.to_thread(store.save_input_images, "job3", request.images)
        store.insert(JobRecord.new("job3", "acme", without_image_bytes(request)), saved)

    asyncio.run(main())
    assert list(store.load_input_images("job3")) == list(request.images)


def test_concurrent_submits_with_images_are_each_known_once_queued(tmp_path: Path) -> None:
    """Saving the images off the loop opens no gap in which a queued job is unknown to the manager (another
    submit announcing queue positions, or dispatch, would look it up)."""

    async def main() -> None:
        async with held_jobs(tmp_path / "state") as (manager, store, tenant):
            requests = [request_with_images() for _ in range(12)]
            for index, request in enumerate(requests):
                request.request_id = f"r{index % 10}"  # two of them repeat a request id
            submitted = await asyncio.gather(*(manager.submit(request, tenant) for request in requests))
            assert sum(created for _, created in submitted) == 10
            assert len({job.job_id for job, _ in submitted}) == 10
            for job, _ in submitted:
                assert not any(image.data for image in job.request.images)
            assert store.usage(tenant.name).active >= 10 * (len(PNG) + len(b"second"))

    asyncio.run(main())


def test_a_request_without_its_image_bytes_keeps_every_other_field() -> None:
    request = request_with_images()
    request.loras.add(name="style", scale=0.5)
    request.interpolation.enable, request.interpolation.exp = True, 2
    request.seed, request.output_format = 7, "mp4"
    cleared = without_image_bytes(request)
    expected = generation_pb2.GenerateRequest()
    expected.CopyFrom(request)
    for image in expected.images:
        image.ClearField("data")
    assert cleared == expected
    assert cleared.ByteSize() < 1024 and request.images[0].data == PNG  # the caller's request is untouched


def test_queued_jobs_hold_no_image_bytes_in_memory(tmp_path: Path) -> None:
    """Ten jobs with a 16 MiB image each: the manager's memory grows by far less than one image per job."""
    from services.allocator import return_large_buffers_to_the_system

    def rss_mib() -> float:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

    return_large_buffers_to_the_system()  # as the orchestrator does: freed 16 MiB buffers leave the process

    async def main() -> float:
        async with held_jobs(tmp_path / "state") as (manager, _, tenant):
            before = rss_mib()
            for _ in range(10):
                request = generation_pb2.GenerateRequest(
                    prompt="a fox", images=[image_pb2.InputImage(data=bytes(16 << 20), sha256="c" * 64)]
                )
                await manager.submit(request, tenant)
                del request
            return rss_mib() - before

    assert asyncio.run(main()) < 48
