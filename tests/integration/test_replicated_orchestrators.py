"""Two orchestrator processes on one PostgreSQL database and one S3 bucket (real servers), in front of fake
stages whose frames depend on the seed:

1. claims: 20 jobs from two tenants, submitted to either replica, each run exactly once (attempts 1, one DiT
   call), every result the expected frames, read back through either replica from the bucket;
2. across replicas: a follower relays a running job's stream, a cancel and a deletion that stop it within a
   step, and the deletion of a finished one (its objects gone);
3. the leader SIGKILLed while a job denoises with others queued: the follower leads, the dead leader's job
   runs again from the queue once its lease expires, and every job finishes with the expected frames, followed
   by the SDK given both replicas' addresses (the dead leader's first);
4. fencing: the leader SIGSTOPped past its leases while it runs a job: the other replica leads, takes the job
   back and finishes it; at SIGCONT the stale owner's writes change nothing and none of its objects stays in the
   bucket, so the job has exactly one result;
5. presigned downloads through the HTTP gateway (in front of both replicas): the content route answers 307 to a
   presigned URL of the bucket, which the official `openai` package and curl follow (the API key stays with the
   gateway), a tampered URL is refused, and deleting the video deletes the object;
6. a rolling upgrade: the leader SIGTERMed while a job denoises: it resigns, finishes that job (run once), and
   exits; the other replica admits meanwhile.

One scenario keeps the servers and processes to one start each; times are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import http.client
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path

import grpc
import numpy as np
import openai
import psycopg
import pytest
import yaml

from services.orchestrator.blobs import S3Blobs, s3_client
from services.orchestrator.tenants import hash_api_key
from stagediff.client import AsyncClient
from stagediff.local.launch import free_ports
from stagediff.local.servers import Postgres, S3Server
from stagediff.tensor_codec import TensorAssembler
from stagediff.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers.replicated import (
    Replica,
    SeededDenoiser,
    expected_frames,
    replica_args,
    s3_environment,
    seeded_stages,
    start_gateway,
)

SUCCEEDED = generation_pb2.JobState.JOB_STATE_SUCCEEDED
CANCELLED = generation_pb2.JobState.JOB_STATE_CANCELLED
KEYS = {"alpha": "sd_alpha-key", "beta": "sd_beta-key"}
SIZE = 32  # frames are SIZE x SIZE
FRAMES = 9
WAIT_S = 120.0  # bound on every wait, never asserted


def _metadata(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def _request(seed: int, steps: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=f"prompt {seed}",
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=steps,
        guidance_scale=1.0,
        seed=seed,
        request_id=f"r{seed}",
    )


class Cluster:
    """The replicas and what the test asks of them."""

    def __init__(self, replicas: list[Replica], database_url: str, denoiser: SeededDenoiser) -> None:
        self.replicas = replicas
        self.database_url = database_url
        self.denoiser = denoiser

    async def leader(self, *, other_than: Replica | None = None) -> Replica:
        """The replica that holds the lease now (waits for one, other than `other_than`)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            endpoint = await asyncio.to_thread(self._leader_endpoint)
            for replica in self.replicas:
                if replica.endpoint == endpoint and replica is not other_than:
                    return replica
            await asyncio.sleep(0.1)
        raise AssertionError("no replica took the lead")

    def _leader_endpoint(self) -> str | None:
        with psycopg.connect(self.database_url) as connection:
            row = connection.execute(
                "SELECT replicas.endpoint FROM leader JOIN replicas ON replicas.replica_id = leader.leader_id"
                " WHERE leader.expires_at > now()"
            ).fetchone()
        return None if row is None else row[0]

    def records(self) -> dict[str, tuple[int, int, str]]:
        """{request id: (state, attempts, owner)} of every stored job."""
        with psycopg.connect(self.database_url) as connection:
            rows = connection.execute("SELECT request_id, state, attempts, owner FROM jobs").fetchall()
        return {row[0]: (row[1], row[2], row[3]) for row in rows}


async def _submit(replica: Replica, tenant: str, request: generation_pb2.GenerateRequest) -> str:
    async with grpc.aio.insecure_channel(replica.endpoint) as channel:
        job = await generation_pb2_grpc.GenerationStub(channel).Submit(request, metadata=_metadata(tenant), timeout=60)
    return job.job_id


async def _watch(replicas: list[Replica], tenant: str, job_id: str) -> tuple[np.ndarray, list[str]]:
    """Every frame of the job, watched through the first replica that answers; a stream cut by a replica's
    death or a takeover is watched again (each time from the start), as a client retrying across replicas.
    Returns the frames and the codes of the cut streams."""
    cuts: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for replica in replicas:
            frames = np.zeros((FRAMES, SIZE, SIZE, 3), np.uint8)
            assembler = TensorAssembler()
            try:
                async with grpc.aio.insecure_channel(replica.endpoint) as channel:
                    stream = generation_pb2_grpc.GenerationStub(channel).WatchJob(
                        generation_pb2.WatchJobRequest(job_id=job_id), metadata=_metadata(tenant), timeout=WAIT_S
                    )
                    async for event in stream:
                        if event.HasField("result") and event.result.HasField("tensor"):
                            tensor = assembler.feed(event.result.tensor)
                            if tensor is not None:
                                frames[tensor.index : tensor.index + tensor.shape[0]] = tensor.array
                        if event.HasField("completed"):
                            return frames, cuts
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                cuts.append(f"{replica.name}: {error.details()}")
            await asyncio.sleep(0.2)
    raise AssertionError(f"job {job_id} never completed; cut streams: {cuts}")


async def _call(replica: Replica, method: str, request, tenant: str):
    async with grpc.aio.insecure_channel(replica.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await getattr(stub, method)(request, metadata=_metadata(tenant), timeout=60)


async def _until(condition, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > WAIT_S:
            raise AssertionError(f"{what} never happened")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def test_replicated_orchestrators(
    tmp_path: Path, postgres_server: Postgres, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3_environment(s3_server).items():
        monkeypatch.setenv(key, value)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        yaml.safe_dump({"tenants": [{"name": name, "api_keys": [hash_api_key(key)]} for name, key in KEYS.items()]})
    )
    asyncio.run(_scenario(tmp_path, postgres_server.new_database(), s3_server, tenants))


async def _scenario(tmp_path: Path, database_url: str, s3: S3Server, tenants: Path) -> None:
    stages = await seeded_stages(step_s=0.01)
    denoiser = stages.denoiser
    assert isinstance(denoiser, SeededDenoiser)
    ports = free_ports(2, "127.0.0.1")
    replicas = [
        Replica(
            name,
            port,
            replica_args(
                stages,
                port=port,
                state_dir=tmp_path / name,
                database_url=database_url,
                s3=s3,
                prefix=tmp_path.name,
                tenants_file=tenants,
                extra=["--job-lease", "3", "--leader-lease", "3", "--presign-downloads", "60"],
            ),
            tmp_path / f"{name}.log",
        )
        for name, port in zip(("a", "b"), ports, strict=True)
    ]
    cluster = Cluster(replicas, database_url, denoiser)
    try:
        await asyncio.gather(*(replica.start() for replica in replicas))
        await _claims(cluster)
        await _across_replicas(cluster)
        await _leader_killed(cluster)
        await _stale_owner_fenced(cluster, s3, tmp_path.name)
        await _presigned_downloads(cluster, tmp_path)
        await _rolling_upgrade(cluster)
    except BaseException:
        for replica in replicas:
            print(f"--- {replica.name} ---\n{replica.log()}")
        raise
    finally:
        for replica in replicas:
            if replica.process is not None and replica.process.returncode is None:
                await replica.kill()
        await stages.stop()


async def _claims(cluster: Cluster) -> None:
    a, b = cluster.replicas
    seeds = list(range(100, 120))
    tenants = ["alpha" if seed % 2 else "beta" for seed in seeds]
    job_ids = await asyncio.gather(
        *(
            _submit(a if seed % 4 < 2 else b, tenant, _request(seed, steps=2))
            for seed, tenant in zip(seeds, tenants, strict=True)
        )
    )
    for seed, tenant, job_id in zip(seeds, tenants, job_ids, strict=True):
        frames, _ = await _watch([b if seed % 2 else a], tenant, job_id)  # either replica, running or finished
        assert np.array_equal(frames, expected_frames(seed, FRAMES, SIZE, SIZE)), seed
    records = await asyncio.to_thread(cluster.records)
    assert {records[f"r{seed}"][:2] for seed in seeds} == {(SUCCEEDED, 1)}, records
    assert all(cluster.denoiser.calls[seed] == 1 for seed in seeds), cluster.denoiser.calls
    # A tenant sees only its own jobs, through either replica.
    listed = await _call(b, "ListJobs", generation_pb2.ListJobsRequest(limit=100), "alpha")
    assert sorted(job.request.request_id for job in listed.jobs) == sorted(f"r{s}" for s in seeds if s % 2)


async def _across_replicas(cluster: Cluster) -> None:
    leader = await cluster.leader()
    follower = next(replica for replica in cluster.replicas if replica is not leader)
    cluster.denoiser.step_s = 0.1
    # A running job's stream, relayed by the follower from the owner.
    watched = await _submit(follower, "alpha", _request(200, steps=10))
    frames, _ = await _watch([follower], "alpha", watched)
    assert np.array_equal(frames, expected_frames(200, FRAMES, SIZE, SIZE))
    # A cancel sent to the follower stops the job within a step.
    doomed = await _submit(follower, "beta", _request(201, steps=50))
    await _until(lambda: 201 in cluster.denoiser.denoising, "the doomed job's denoising")
    job = await _call(follower, "CancelJob", generation_pb2.CancelJobRequest(job_id=doomed), "beta")
    stopped_after = await _until(lambda: 201 not in cluster.denoiser.denoising, "the cancelled call's end")
    assert job.state == CANCELLED
    print(f"\ncancel through the follower: the DiT call ended {stopped_after:.2f} s after the answer")
    # A running job deleted through the follower stops within a step and is gone from both replicas.
    deleted = await _submit(follower, "beta", _request(202, steps=50))
    await _until(lambda: 202 in cluster.denoiser.denoising, "the deleted job's denoising")
    answer = await _call(follower, "DeleteJob", generation_pb2.DeleteJobRequest(job_id=deleted), "beta")
    assert answer.deleted and 202 not in cluster.denoiser.denoising
    for replica in (leader, follower):
        with pytest.raises(grpc.aio.AioRpcError) as gone_everywhere:
            await _call(replica, "GetJob", generation_pb2.GetJobRequest(job_id=deleted), "beta")
        assert gone_everywhere.value.code() == grpc.StatusCode.NOT_FOUND
    # Another tenant's job is as unknown through either replica.
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await _call(follower, "GetJob", generation_pb2.GetJobRequest(job_id=watched), "beta")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    # A finished job deleted through the follower: its objects go with it.
    answer = await _call(follower, "DeleteJob", generation_pb2.DeleteJobRequest(job_id=watched), "alpha")
    assert answer.deleted
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await _call(leader, "GetJob", generation_pb2.GetJobRequest(job_id=watched), "alpha")
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


async def _leader_killed(cluster: Cluster) -> None:
    leader = await cluster.leader()
    follower = next(replica for replica in cluster.replicas if replica is not leader)
    cluster.denoiser.step_s = 0.05
    seeds = [300, 301, 302]
    # The SDK given both replicas' addresses, the leader's first: it watches there until the leader dies, then
    # goes on through the other.
    client = AsyncClient(f"{leader.endpoint},{follower.endpoint}", api_key=KEYS["alpha"], timeout=WAIT_S)
    try:
        job_ids = [(await client.submit("p", **_options(seed, steps=40))).job_id for seed in seeds]
        waits = [asyncio.create_task(client.wait(job_id)) for job_id in job_ids]
        await _until(lambda: 300 in cluster.denoiser.denoising, "the first job's denoising")
        await leader.kill()
        killed = time.monotonic()
        await cluster.leader(other_than=leader)
        print(f"\nleader SIGKILLed: {follower.name} leads {time.monotonic() - killed:.1f} s later")
        results = await asyncio.gather(*waits)
    finally:
        await client.close()
    for seed, result in zip(seeds, results, strict=True):
        assert np.array_equal(result.frames, expected_frames(seed, FRAMES, SIZE, SIZE)), seed
    finished_after = time.monotonic() - killed
    print(f"every job finished {finished_after:.1f} s after the kill; DiT calls {dict(cluster.denoiser.calls)}")
    records = await asyncio.to_thread(cluster.records)
    assert all(records[f"r{seed}"][0] == SUCCEEDED for seed in seeds)
    await leader.start()  # back, as a follower


def _options(seed: int, steps: int) -> dict[str, object]:
    request = _request(seed, steps)
    return {
        "height": request.height,
        "width": request.width,
        "num_frames": request.num_frames,
        "num_inference_steps": request.num_inference_steps,
        "guidance_scale": request.guidance_scale,
        "seed": request.seed,
        "request_id": request.request_id,
    }


async def _stale_owner_fenced(cluster: Cluster, s3: S3Server, prefix: str) -> None:
    stale = await cluster.leader()
    other = next(replica for replica in cluster.replicas if replica is not stale)
    cluster.denoiser.step_s = 0.05
    job_id = await _submit(stale, "beta", _request(500, steps=50))
    await _until(lambda: 500 in cluster.denoiser.denoising, "the job's denoising")
    stale.signal(signal.SIGSTOP)
    try:
        assert await cluster.leader(other_than=stale) is other
        frames, _ = await _watch([other], "beta", job_id)  # requeued once its lease expired, run by the other
    finally:
        stale.signal(signal.SIGCONT)
    assert np.array_equal(frames, expected_frames(500, FRAMES, SIZE, SIZE))
    await _until(lambda: cluster.denoiser.calls[500] == 2 and 500 not in cluster.denoiser.denoising, "the end")
    state, attempts, owner = (await asyncio.to_thread(cluster.records))["r500"]
    assert (state, attempts) == (SUCCEEDED, 2)
    bucket = S3Blobs(
        s3_client(s3.endpoint, s3.access_key, s3.secret_key, checksums="when_required"),
        s3.bucket,
        f"{prefix}/",
    )
    # The stale owner wakes and finds its lease lost (its keeper's renewal, or a fenced write); nothing of it may
    # stay in the bucket (its deletes run in the background, so the bucket is read until they are done).
    stopped = ("lease was lost", "lost the lease", "moved to another orchestrator replica")
    await _until(lambda: any(words in stale.log() for words in stopped), "the stale owner's stop")
    expected = [f"{job_id}/e2/result-frames.npy"]
    deadline = time.monotonic() + WAIT_S
    while (keys := sorted(await asyncio.to_thread(lambda: list(bucket.keys(f"{job_id}/"))))) != expected:
        assert time.monotonic() < deadline, keys
        await asyncio.sleep(0.1)
    frames, _ = await _watch([stale], "beta", job_id)  # the stale one serves the finished job from the bucket
    assert np.array_equal(frames, expected_frames(500, FRAMES, SIZE, SIZE)) and owner != ""


async def _presigned_downloads(cluster: Cluster, tmp_path: Path) -> None:
    gateway, url = await start_gateway(cluster.replicas, tmp_path / "gateway.log")
    try:
        await asyncio.to_thread(_download_through_the_bucket, url)
    finally:
        gateway.terminate()
        await gateway.wait()


def _download_through_the_bucket(url: str) -> None:
    client = openai.OpenAI(api_key=KEYS["alpha"], base_url=f"{url}/v1", max_retries=0, timeout=60)
    video = client.videos.create(prompt="a fox", size="32x32", seconds="1")
    deadline = time.monotonic() + WAIT_S
    while (video := client.videos.retrieve(video.id)).status != "completed":
        assert video.status in ("queued", "in_progress") and time.monotonic() < deadline, video
        time.sleep(0.1)
    content = f"{url}/v1/videos/{video.id}/content"
    status, location = _get(content, {"Authorization": f"Bearer {KEYS['alpha']}"})
    assert status == 307, location
    assert "X-Amz-Signature=" in location and KEYS["alpha"] not in location
    through_openai = client.videos.download_content(video.id).read()
    assert through_openai[4:8] == b"ftyp"  # an MP4, from the bucket
    curl = subprocess.run(
        ["curl", "-sSfL", "-H", f"Authorization: Bearer {KEYS['alpha']}", content], capture_output=True, timeout=60
    )
    assert curl.returncode == 0 and curl.stdout == through_openai, curl.stderr
    tampered = location.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    assert _get(tampered)[0] == 403
    client.videos.delete(video.id)
    deadline = time.monotonic() + WAIT_S
    while _get(location)[0] != 404:  # the object goes with the video (deleted in the background)
        assert time.monotonic() < deadline, "the deleted video's object is still in the bucket"
        time.sleep(0.1)


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """(status, Location header or body) of one GET, redirects not followed."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", f"{parts.path}?{parts.query}" if parts.query else parts.path, headers=headers or {})
        answer = connection.getresponse()
        return answer.status, answer.getheader("location") or answer.read().decode(errors="replace")
    finally:
        connection.close()


async def _rolling_upgrade(cluster: Cluster) -> None:
    leader = await cluster.leader()
    follower = next(replica for replica in cluster.replicas if replica is not leader)
    cluster.denoiser.step_s = 0.1
    job_id = await _submit(leader, "beta", _request(400, steps=20))
    await _until(lambda: 400 in cluster.denoiser.denoising, "the job's denoising")
    leader.signal(signal.SIGTERM)
    assert await cluster.leader(other_than=leader) is follower
    admitted = await _submit(follower, "alpha", _request(401, steps=1))  # admissions go on meanwhile
    assert await leader.stop() == 0
    frames, _ = await _watch([follower], "beta", job_id)
    assert np.array_equal(frames, expected_frames(400, FRAMES, SIZE, SIZE))
    await _watch([follower], "alpha", admitted)
    records = await asyncio.to_thread(cluster.records)
    assert records["r400"][:2] == (SUCCEEDED, 1) and cluster.denoiser.calls[400] == 1, records
