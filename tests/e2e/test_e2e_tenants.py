"""Tenants end to end: API keys and isolation, size quotas, overload and rate limits, cancellation and
deadlines, idempotent request ids, on the pooled tenants cluster (tests/helpers/tenants_cluster.py), whose
tenants file also holds test_fuzz.py's tenants; these tests call only with their own. The last test restarts
the orchestrator (SIGTERM, then started again), which leaves the cluster serving as it found it.

Tenants: alpha (high priority, no quotas), beta (normal, no quotas), gamma (low priority, one job running and
two queued at most, small requests only) and delta (a rate limit with a burst of two).

Measured numbers (cancellation latency, DiT steps after a cancel, another tenant's latency under overload)
are printed for `pytest -s`; the tests assert only on outcomes, never on time.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.orchestrator.tenants import new_api_key
from stagediff import Client, StageDiffError
from stagediff.client import AsyncClient, GenerationResult, Progress, RetryPolicy
from stagediff.local.supervisor import LocalCluster
from stagediff.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers.cluster_pool import ClusterPool
from tests.helpers.grpc_channels import assert_status
from tests.helpers.tenants_cluster import GAMMA_QUOTAS, SERVICE_TENANTS, TenantsFile, tenants_cluster

pytestmark = pytest.mark.e2e

# alpha is also the operator's tenant (GetClusterInfo); the others are customers.
TENANTS = SERVICE_TENANTS
GENERATION_RPCS = {
    "Generate",
    "Submit",
    "WatchJob",
    "GetJob",
    "CancelJob",
    "ListJobs",
    "ListModels",
    "GetClusterInfo",
    "UploadImage",
}

TINY = dict(height=32, width=32, num_frames=1, num_inference_steps=1, guidance_scale=1.0)
SMALL = dict(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0)
# At gamma's limits: 64x64 = max_pixels, 9 frames, 4 steps.
GAMMA_JOB = dict(height=64, width=64, num_frames=9, num_inference_steps=4, guidance_scale=5.0)
# Long enough to still be running while another tenant tries to reach it (about a second of denoising).
LONG = dict(height=64, width=64, num_frames=9, num_inference_steps=200, guidance_scale=5.0)
# Tens of milliseconds a DiT step, long beside a call's round trip: a cancel lands inside a known step.
CANCELLED_JOB = dict(height=256, width=256, num_frames=9, num_inference_steps=20, guidance_scale=5.0)
# Half a minute of denoising if nothing stopped it: far beyond its deadline and STOP_WAIT_S.
OUTLIVES_DEADLINE = dict(height=256, width=256, num_frames=9, num_inference_steps=1000, guidance_scale=5.0)
DEADLINE_S = 3.0
TERMINAL = (generation_pb2.JOB_STATE_SUCCEEDED, generation_pb2.JOB_STATE_FAILED, generation_pb2.JOB_STATE_CANCELLED)
# Bound on every poll for a state change.
WAIT_S = 20.0
# How long the DiT may take to stop after a cancel or a deadline; a DiT that ran on to the end would take longer.
STOP_WAIT_S = 10.0
DIT_STOPPED = "request cancelled; compute stopped"


@dataclass
class TenantCluster:
    cluster: LocalCluster
    keys: dict[str, str]

    @property
    def endpoint(self) -> str:
        return self.cluster.endpoint

    def client(self, tenant: str) -> Client:
        """A client of `tenant` that does not retry RESOURCE_EXHAUSTED itself, so that each refusal reaches the
        test as the orchestrator gave it (the SDK's retry of it is tested in test_sdk_errors.py)."""
        return Client(self.endpoint, api_key=self.keys[tenant], retry=RetryPolicy(rate_limit_retries=0))


@pytest.fixture(scope="module")
def tenant_cluster(tiny_model: Path, cluster_pool: ClusterPool, tenants_file: TenantsFile) -> TenantCluster:
    """The pooled tenants cluster, with the keys of this module's tenants only."""
    keys = {name: tenants_file.keys[name] for name in TENANTS}
    return TenantCluster(tenants_cluster(cluster_pool, tiny_model, tenants_file), keys)


# ----------------------------------------------------------------- helpers --


def _poll(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up after {timeout:g} s waiting for {what}"
        time.sleep(0.05)


def _dit_stops(cluster: LocalCluster) -> list[float]:
    """Times (epoch seconds) at which the DiT's compute stopped for a cancelled call, from its JSON log."""
    assert cluster.log_dir is not None
    stops = []
    for line in (cluster.log_dir / "dit.log").read_text().splitlines():
        if line.startswith("{") and DIT_STOPPED in line:
            stops.append(datetime.datetime.fromisoformat(json.loads(line)["time"]).timestamp())
    return stops


def _idle(client: Client) -> bool:
    """No stage call in flight on any replica, and every replica serving."""
    replicas = [replica for stage in client.cluster_info().stages for replica in stage.replicas]
    return all(replica.in_flight == 0 and replica.health == "SERVING" for replica in replicas)


def _request_for(method, job_id: str):
    """A well-formed request for a Generation method: only the credentials can be wrong with it."""
    request = method.input_type._concrete_class()
    fields = request.DESCRIPTOR.fields_by_name
    if "job_id" in fields:
        request.job_id = job_id
    if "prompt" in fields:
        request.prompt = "unauthenticated probe"
        request.request_id = uuid.uuid4().hex
        for name, value in TINY.items():
            setattr(request, name, value)
    return request


def _refusal(stub, method, request, metadata) -> grpc.RpcError | None:
    """The error a call ends with, or None when it succeeds."""
    call = getattr(stub, method.name)
    if method.client_streaming:  # UploadImage: its chunks
        request = iter([request])
    try:
        if method.server_streaming:
            list(call(request, metadata=metadata, timeout=30))
        else:
            call(request, metadata=metadata, timeout=30)
    except grpc.RpcError as error:
        return error
    return None


def _shape(job: dict) -> str:
    return f"{job['height']}x{job['width']}x{job['num_frames']}, {job['num_inference_steps']} steps, CFG"


def _code_name(value: int) -> str:
    return next(code.name for code in grpc.StatusCode if code.value[0] == value)


def _ids(jobs) -> set[str]:
    return {job.job_id for job in jobs}


# ------------------------------------------------------------ keys, isolation --


def test_every_generation_rpc_refuses_a_missing_or_wrong_key(tenant_cluster: TenantCluster) -> None:
    alpha_key = tenant_cluster.keys["alpha"]
    with tenant_cluster.client("alpha") as alpha:
        job_id = alpha.submit("alpha's job", seed=1, **TINY).job_id
        assert alpha.get_job(job_id).job_id == job_id  # the id is real: only the key can be refused

    altered = alpha_key[:-1] + ("A" if alpha_key[-1] != "A" else "B")
    credentials = {
        "no key": (),
        "an unknown key": (("authorization", f"Bearer {new_api_key()}"),),
        "an altered key": (("authorization", f"Bearer {altered}"),),
        "a key without 'Bearer'": (("authorization", alpha_key),),
        "another scheme": (("authorization", f"Basic {alpha_key}"),),
    }
    methods = generation_pb2.DESCRIPTOR.services_by_name["Generation"].methods
    assert {method.name for method in methods} >= GENERATION_RPCS
    with grpc.insecure_channel(tenant_cluster.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for method in methods:
            for label, metadata in credentials.items():
                error = _refusal(stub, method, _request_for(method, job_id), metadata)
                assert error is not None, f"{method.name} with {label} was answered"
                assert_status(error, grpc.StatusCode.UNAUTHENTICATED)
                for _, value in metadata:
                    presented = value.split()[-1]
                    assert presented not in (error.details() or ""), f"{method.name} echoed the key it was given"
                    assert presented[8:24] not in (error.details() or "")

    # The SDK raises it as a StageDiffError.
    with Client(tenant_cluster.endpoint, api_key=new_api_key()) as stranger, pytest.raises(StageDiffError) as raised:
        stranger.list_models()
    assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED and "API key" in raised.value.message

    # No refused Submit or Generate became a job, for any tenant.
    for tenant in TENANTS:
        with tenant_cluster.client(tenant) as client:
            assert not [job for job in client.list_jobs() if job.request.prompt == "unauthenticated probe"]


def test_health_and_reflection_need_no_key(tenant_cluster: TenantCluster) -> None:
    with grpc.insecure_channel(tenant_cluster.endpoint) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "stagediff.v1.Generation"):
            response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING, service
        listing = list(
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
    assert "stagediff.v1.Generation" in {s.name for s in listing[0].list_services_response.service}
    with Client(tenant_cluster.endpoint, api_key="") as anonymous:
        assert anonymous.health() == "SERVING"


def _assert_hidden(job_id: str, other: Client) -> None:
    """`other` (another tenant) can neither watch, fetch, cancel nor list the job, and learns nothing from its id."""
    unknown = uuid.uuid4().hex
    for name, call in (("GetJob", other.get_job), ("CancelJob", other.cancel), ("WatchJob", other.wait)):
        with pytest.raises(StageDiffError) as raised:
            call(job_id)
        assert raised.value.code == grpc.StatusCode.NOT_FOUND, name
        with pytest.raises(StageDiffError) as never_existed:
            call(unknown)
        # Another tenant's job answers exactly as a job that never existed.
        assert raised.value.message.replace(job_id, "ID") == never_existed.value.message.replace(unknown, "ID"), name
    for state in (generation_pb2.JOB_STATE_UNSPECIFIED, *TERMINAL, generation_pb2.JOB_STATE_RUNNING):
        assert job_id not in _ids(other.list_jobs(state=state))


def test_a_tenant_cannot_see_or_touch_another_tenants_job(tenant_cluster: TenantCluster) -> None:
    with tenant_cluster.client("alpha") as alpha, tenant_cluster.client("beta") as beta:
        job = alpha.submit("alpha's private job", seed=2, **LONG)
        _assert_hidden(job.job_id, beta)
        # Beta's CancelJob did nothing: alpha's job runs on and succeeds.
        assert alpha.get_job(job.job_id).state in (generation_pb2.JOB_STATE_QUEUED, generation_pb2.JOB_STATE_RUNNING)
        result = alpha.wait(job.job_id)
        assert result.frames.shape == (9, 64, 64, 3)
        finished = alpha.get_job(job.job_id)
        assert finished.state == generation_pb2.JOB_STATE_SUCCEEDED and not finished.HasField("error")
        assert job.job_id in _ids(alpha.list_jobs())
        _assert_hidden(job.job_id, beta)  # and the same once it has finished


# ------------------------------------------------------------------ size quotas --


@pytest.mark.parametrize("rpc", ["submit", "generate"])
@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(num_inference_steps=5), ["num_inference_steps: 5", "limit of 4"]),
        (dict(height=80), ["height: 80", "limit of 64"]),
        (dict(width=112), ["width: 112", "limit of 96"]),
        (dict(num_frames=13), ["num_frames: 13", "limit of 9"]),
        (dict(width=80), ["height*width", "5120 pixels", "limit of 4096"]),
    ],
    ids=["steps", "height", "width", "frames", "pixels"],
)
def test_a_request_beyond_the_tenants_size_limits_is_permission_denied(
    tenant_cluster: TenantCluster, rpc: str, fields: dict, words: list[str]
) -> None:
    prompt = f"too large: {uuid.uuid4().hex}"
    with tenant_cluster.client("gamma") as gamma:
        with pytest.raises(StageDiffError) as raised:
            getattr(gamma, rpc)(prompt, seed=3, **{**GAMMA_JOB, **fields})
        assert raised.value.code == grpc.StatusCode.PERMISSION_DENIED
        for word in [*words, "tenant 'gamma'"]:
            assert word in raised.value.message, f"'{word}' not named in: {raised.value.message}"
        assert raised.value.retry_after is None  # waiting cannot help
        assert prompt not in {job.request.prompt for job in gamma.list_jobs()}


def test_the_same_request_is_within_another_tenants_quotas(tenant_cluster: TenantCluster) -> None:
    with tenant_cluster.client("beta") as beta:
        result = beta.generate(
            "large for gamma", seed=4, height=64, width=80, num_frames=13, num_inference_steps=5, guidance_scale=1.0
        )
    assert result.frames.shape == (13, 64, 80, 3)


# ------------------------------------------------------------ overload, rate --


QUOTA = GAMMA_QUOTAS["max_running_jobs"] + GAMMA_QUOTAS["max_queued_jobs"]
BURST = 10 * QUOTA
SAMPLES = 5


class _Overload(threading.Thread):
    """Keeps a tenant at ten times its quota: a burst of BURST Submits at once, and another each time one of its
    accepted jobs ends, until stopped; then follows every accepted job to its end."""

    def __init__(self, tenant_cluster: TenantCluster, tenant: str) -> None:
        super().__init__(name=f"overload-{tenant}", daemon=True)
        self.endpoint = tenant_cluster.endpoint
        self.key = tenant_cluster.keys[tenant]
        self.stop_requested = threading.Event()
        self.first_burst = threading.Event()
        self.bursts: list[tuple[int, int]] = []  # (accepted, refused) per burst
        self.accepted: list[str] = []
        self.refused: list[StageDiffError] = []
        self.counts_after_burst: list[tuple[int, int]] = []  # (running, queued) the tenant lists after each burst
        self.results: dict[str, GenerationResult] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._overload())
        except BaseException as error:  # reported by the test
            self.error = error
        finally:
            self.first_burst.set()

    async def _follow(self, client: AsyncClient, job_id: str) -> None:
        self.results[job_id] = await client.wait(job_id)

    async def _overload(self) -> None:
        async with AsyncClient(self.endpoint, api_key=self.key) as client:
            followers: set[asyncio.Task] = set()
            while True:
                outcomes = await asyncio.gather(
                    *(client.submit("overload", seed=5, **GAMMA_JOB) for _ in range(BURST)), return_exceptions=True
                )
                accepted = [outcome for outcome in outcomes if isinstance(outcome, generation_pb2.Job)]
                refused = [outcome for outcome in outcomes if isinstance(outcome, StageDiffError)]
                unexpected = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, StageDiffError)]
                if unexpected:
                    raise unexpected[0]
                self.bursts.append((len(accepted), len(refused)))
                self.refused += refused
                for job in accepted:
                    self.accepted.append(job.job_id)
                    followers.add(asyncio.create_task(self._follow(client, job.job_id)))
                running = await client.list_jobs(state=generation_pb2.JOB_STATE_RUNNING)
                queued = await client.list_jobs(state=generation_pb2.JOB_STATE_QUEUED)
                self.counts_after_burst.append((len(running), len(queued)))
                self.first_burst.set()
                if self.stop_requested.is_set():
                    break
                pending = {task for task in followers if not task.done()}
                if pending:
                    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.gather(*followers)


def _timed_generate(client: Client, prompt: str, seed: int) -> float:
    started = time.perf_counter()
    result = client.generate(prompt, seed=seed, **SMALL)
    assert result.frames.shape == (9, 64, 64, 3)
    return time.perf_counter() - started


def test_a_tenant_at_ten_times_its_quota_is_refused_while_another_is_served(tenant_cluster: TenantCluster) -> None:
    with tenant_cluster.client("beta") as beta, tenant_cluster.client("gamma") as gamma:
        _timed_generate(beta, "warm-up", 6)
        quiet = [_timed_generate(beta, "quiet", 7 + i) for i in range(SAMPLES)]

        overload = _Overload(tenant_cluster, "gamma")
        overload.start()
        try:
            assert overload.first_burst.wait(timeout=120), "the first burst never ended"
            loaded, gamma_busy = [], 0
            for i in range(SAMPLES):
                busy = gamma.list_jobs(state=generation_pb2.JOB_STATE_RUNNING)
                gamma_busy += bool(busy)
                assert len(busy) <= GAMMA_QUOTAS["max_running_jobs"]
                # Beta is never refused: generate raises on any refusal.
                loaded.append(_timed_generate(beta, "under overload", 7 + i))
        finally:
            overload.stop_requested.set()
            overload.join(timeout=300)
        assert not overload.is_alive(), "the overloading tenant's jobs did not finish"
        if overload.error is not None:
            raise overload.error

        # The first burst filled gamma's quota and every other request of it was refused, with a RetryInfo.
        first_accepted, first_refused = overload.bursts[0]
        assert first_accepted >= QUOTA and first_accepted + first_refused == BURST and first_refused > 0
        for error in overload.refused:
            assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            assert error.retry_after is not None and error.retry_after > 0, error
            assert "tenant 'gamma'" in error.message and "queued" in error.message
        for running, queued in overload.counts_after_burst:
            assert running <= GAMMA_QUOTAS["max_running_jobs"] and queued <= GAMMA_QUOTAS["max_queued_jobs"]
        # Every accepted job ran to its end.
        assert sorted(overload.results) == sorted(overload.accepted)
        assert all(result.frames.shape == (9, 64, 64, 3) for result in overload.results.values())
        assert all(gamma.get_job(job_id).state == generation_pb2.JOB_STATE_SUCCEEDED for job_id in overload.accepted)
        assert gamma_busy > 0, "gamma had no job running while beta's latency was measured"

    retry_afters = [error.retry_after for error in overload.refused]
    print(
        f"\noverload: gamma sent {len(overload.bursts)} bursts of {BURST} (10x its quota of {QUOTA}): "
        f"{len(overload.accepted)} accepted, {len(overload.refused)} refused RESOURCE_EXHAUSTED with "
        f"retry_after {min(retry_afters):.2f}-{max(retry_afters):.2f} s"
        f"\noverload: beta latency (median of {SAMPLES}, 64x64x9, 2 steps): {statistics.median(quiet):.3f} s quiet, "
        f"{statistics.median(loaded):.3f} s under gamma's overload "
        f"(x{statistics.median(loaded) / statistics.median(quiet):.2f}; gamma running during {gamma_busy}/{SAMPLES})"
        f"\noverload: beta quiet {[round(t, 3) for t in quiet]}, loaded {[round(t, 3) for t in loaded]}"
    )


def test_the_rate_limit_refuses_with_retry_info_and_the_advised_wait_works(tenant_cluster: TenantCluster) -> None:
    with tenant_cluster.client("delta") as delta:
        accepted = [delta.submit("within the burst", seed=8 + i, **TINY) for i in range(2)]
        refusals = []
        for rpc in (delta.submit, delta.generate):
            with pytest.raises(StageDiffError) as raised:
                rpc("over the rate", seed=10, **TINY)
            refusals.append(raised.value)
        for error in refusals:
            assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tenant 'delta'" in error.message and "30 requests per minute" in error.message
            # At most one token's refill time (2 s at 30 a minute).
            assert error.retry_after is not None and 0 < error.retry_after <= 2.0
        # The client is told how long to wait; waiting that long is enough.
        time.sleep(refusals[-1].retry_after)
        accepted.append(delta.submit("after the advised wait", seed=11, **TINY))
        for job in accepted:
            assert delta.wait(job.job_id).frames.shape == (1, 32, 32, 3)
        assert not [job for job in delta.list_jobs() if job.request.prompt == "over the rate"]
    print(f"\nrate limit: refused with retry_after {refusals[0].retry_after:.2f} s, {refusals[1].retry_after:.2f} s")


# ------------------------------------------------------- cancel, deadline --


def test_cancel_mid_denoise_stops_the_dit_within_a_step(tenant_cluster: TenantCluster) -> None:
    stops_before = len(_dit_stops(tenant_cluster.cluster))
    total = CANCELLED_JOB["num_inference_steps"]
    with tenant_cluster.client("alpha") as alpha, tenant_cluster.client("alpha") as control:
        dit_steps: list[float] = []
        after_cancel = 0
        cancel_sent = None
        with pytest.raises(StageDiffError) as raised:
            for event in alpha.stream("cancelled mid-denoise", seed=12, **CANCELLED_JOB):
                if not (isinstance(event, Progress) and event.stage == "dit"):
                    continue
                if cancel_sent is not None:
                    after_cancel += 1
                    continue
                dit_steps.append(time.time())
                if len(dit_steps) == 2:  # after the first step, with one step's duration measured
                    job_id = event.job_id
                    cancel_sent = time.time()
                    answer = control.cancel(job_id)
        client_saw_end = time.time()
        assert cancel_sent is not None, "the job ended before its second denoising step"
        assert raised.value.code == grpc.StatusCode.CANCELLED
        assert answer.state == generation_pb2.JOB_STATE_CANCELLED
        assert after_cancel <= 1, f"{after_cancel} DiT steps reached the client after the cancel"
        assert len(dit_steps) + after_cancel < total, "the cancel came after the denoising had ended"
        job = alpha.get_job(job_id)
        assert job.state == generation_pb2.JOB_STATE_CANCELLED
        assert job.error.code == grpc.StatusCode.CANCELLED.value[0] and job.current_stage == ""

        # The DiT itself stopped its compute for the cancelled call.
        _poll(lambda: len(_dit_stops(tenant_cluster.cluster)) > stops_before, "the DiT to stop", STOP_WAIT_S)
        dit_stopped = _dit_stops(tenant_cluster.cluster)[-1]
        _poll(lambda: _idle(control), "every stage replica to be idle")

        # The DiT is free: a new job runs at once.
        first_step = None
        steps = 0
        for event in alpha.stream("right after the cancel", seed=13, **{**SMALL, "num_inference_steps": 20}):
            if isinstance(event, Progress) and event.stage == "dit":
                first_step = first_step or time.time()
                steps += 1
            if isinstance(event, GenerationResult):
                result = event
        assert steps == 20 and result.frames.shape == (9, 64, 64, 3)

    step_s = dit_steps[1] - dit_steps[0]
    server_end = job.finished_at.ToNanoseconds() / 1e9
    print(
        f"\ncancel: DiT step {step_s * 1000:.1f} ms ({_shape(CANCELLED_JOB)}); "
        f"{after_cancel} DiT step(s) reached the client after the cancel; "
        f"job CANCELLED {server_end - cancel_sent:.3f} s after the cancel was sent "
        f"(client saw the end after {client_saw_end - cancel_sent:.3f} s)"
        f"\ncancel: DiT compute stopped {dit_stopped - cancel_sent:.3f} s after the cancel "
        f"(~{(dit_stopped - cancel_sent) / step_s:.2f} steps); the next job's first DiT step came "
        f"{first_step - cancel_sent:.3f} s after the cancel"
    )


def test_a_client_deadline_shorter_than_the_job_frees_every_stage(tenant_cluster: TenantCluster) -> None:
    stops_before = len(_dit_stops(tenant_cluster.cluster))
    request_id = f"deadline-{uuid.uuid4().hex}"
    with tenant_cluster.client("alpha") as alpha:
        dit_steps = 0
        with pytest.raises(StageDiffError) as raised:
            for event in alpha.stream(
                "outlives its deadline", seed=14, request_id=request_id, timeout=DEADLINE_S, **OUTLIVES_DEADLINE
            ):
                dit_steps += isinstance(event, Progress) and event.stage == "dit"
        expired = time.time()
        assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert dit_steps >= 1, "the deadline passed before the denoising began"

        (job,) = [job for job in alpha.list_jobs() if job.request.request_id == request_id]
        _poll(lambda: alpha.get_job(job.job_id).state in TERMINAL, "the job to end")
        ended = alpha.get_job(job.job_id)
        # Three outcomes race, each naming why: a stage call hits the job's deadline first (FAILED), or the
        # Generate stream ends and cancels the job, finding the deadline passed (CANCELLED with
        # DEADLINE_EXCEEDED) or, a moment before it passes on the server's clock, a cancelled call.
        assert (ended.state, ended.error.code) in {
            (generation_pb2.JOB_STATE_FAILED, grpc.StatusCode.DEADLINE_EXCEEDED.value[0]),
            (generation_pb2.JOB_STATE_CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED.value[0]),
            (generation_pb2.JOB_STATE_CANCELLED, grpc.StatusCode.CANCELLED.value[0]),
        }, ended
        _poll(lambda: len(_dit_stops(tenant_cluster.cluster)) > stops_before, "the DiT to stop", STOP_WAIT_S)
        dit_stopped = _dit_stops(tenant_cluster.cluster)[-1]
        _poll(lambda: _idle(alpha), "every stage replica to be idle")
        idle_at = time.time()

        result = alpha.generate("after the deadline", seed=15, **SMALL)
        assert result.frames.shape == (9, 64, 64, 3)
        assert _idle(alpha)
    print(
        f"\ndeadline: {DEADLINE_S:g} s deadline hit after {dit_steps} DiT steps of "
        f"{OUTLIVES_DEADLINE['num_inference_steps']}; job {generation_pb2.JobState.Name(ended.state)} "
        f"({_code_name(ended.error.code)}: {ended.error.message!r}); "
        f"DiT compute stopped {dit_stopped - expired:+.3f} s and every stage idle {idle_at - expired:+.3f} s "
        "from when the client saw DEADLINE_EXCEEDED"
    )


# ----------------------------------------------------------------- idempotency --


def test_request_ids_are_per_tenant(tenant_cluster: TenantCluster) -> None:
    request_id = f"shared-{uuid.uuid4().hex}"
    with tenant_cluster.client("alpha") as alpha, tenant_cluster.client("beta") as beta:
        first = alpha.submit("same id", seed=16, request_id=request_id, **TINY)
        again = alpha.submit("same id", seed=16, request_id=request_id, **TINY)
        other = beta.submit("same id", seed=16, request_id=request_id, **TINY)
        assert again.job_id == first.job_id
        assert other.job_id != first.job_id
        assert alpha.wait(first.job_id).frames.shape == beta.wait(other.job_id).frames.shape == (1, 32, 32, 3)
        # Once finished, the id still names the same job: a retried Submit or Generate attaches to it.
        assert alpha.submit("same id", seed=16, request_id=request_id, **TINY).job_id == first.job_id
        assert alpha.generate("same id", seed=16, request_id=request_id, **TINY).job_id == first.job_id
        assert beta.submit("same id", seed=16, request_id=request_id, **TINY).job_id == other.job_id
        alpha_jobs = [job for job in alpha.list_jobs() if job.request.request_id == request_id]
        beta_jobs = [job for job in beta.list_jobs() if job.request.request_id == request_id]
        assert _ids(alpha_jobs) == {first.job_id} and _ids(beta_jobs) == {other.job_id}
        with pytest.raises(StageDiffError) as raised:
            beta.get_job(first.job_id)
        assert raised.value.code == grpc.StatusCode.NOT_FOUND


def test_isolation_and_request_ids_hold_for_jobs_served_from_the_store(tenant_cluster: TenantCluster) -> None:
    """After a restart of the orchestrator, finished jobs come from its store: the same rules hold there."""
    request_id = f"stored-{uuid.uuid4().hex}"
    with tenant_cluster.client("alpha") as alpha, tenant_cluster.client("beta") as beta:
        mine = alpha.submit("stored", seed=17, request_id=request_id, **TINY)
        theirs = beta.submit("stored", seed=17, request_id=request_id, **TINY)
        frames = alpha.wait(mine.job_id).frames
        beta.wait(theirs.job_id)
    tenant_cluster.cluster.kill("orchestrator", signal.SIGTERM)
    tenant_cluster.cluster.restart("orchestrator")
    with tenant_cluster.client("alpha") as alpha, tenant_cluster.client("beta") as beta:
        _assert_hidden(mine.job_id, beta)
        _assert_hidden(theirs.job_id, alpha)
        assert np.array_equal(alpha.wait(mine.job_id).frames, frames)
        assert alpha.get_job(mine.job_id).state == generation_pb2.JOB_STATE_SUCCEEDED
        assert alpha.submit("stored", seed=17, request_id=request_id, **TINY).job_id == mine.job_id
        assert beta.submit("stored", seed=17, request_id=request_id, **TINY).job_id == theirs.job_id
