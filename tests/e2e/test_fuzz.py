"""Random and malformed requests against every public and stage RPC of a running cluster.

Each call must end with a status code that says what happened: OK, or a refusal (INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED, ...); DEADLINE_EXCEEDED only where this test set a short deadline or the request was accepted
and is still working; CANCELLED only where this test cancelled; UNAUTHENTICATED only for a stage call without the
cluster secret. Never UNKNOWN, INTERNAL, UNAVAILABLE, UNIMPLEMENTED for a method that exists, and never a hang
(every call has a deadline). Afterwards every service still serves, every job accepted during the fuzzing is
listed and finished, and a normal generation still works.

The test runs twice, on two clusters: `open` (the shared default cluster: every caller is the open tenant) fuzzes
every public and stage RPC; `tenants` (the pooled tenants cluster of tests/helpers/tenants_cluster.py, whose file
also holds test_e2e_tenants.py's tenants; this test calls with its own two tenants' keys, their quotas: rates and
bursts, running and queued jobs, request and output sizes) fuzzes every public RPC with credentials drawn from those
tenants' valid keys, unknown and altered keys, malformed authorization metadata and none. There, in addition: a call
without a valid key ends with UNAUTHENTICATED and nothing else (RESOURCE_EXHAUSTED too for a message larger than the
server takes, which grpc refuses before any handler sees it; DEADLINE_EXCEEDED where this test set a short
deadline), and its status message never quotes the key it presented; every refusal of Submit or Generate with
RESOURCE_EXHAUSTED (a spent rate, a full queue) carries a positive RetryInfo, and the tenant with the small rate was
refused so; a tenant never sees the other's jobs (GetJob, WatchJob and CancelJob answer NOT_FOUND, ListJobs never
lists them, a request id the other used gives a job of its own); a job never makes more frames than its tenant's
`max_output_frames`; GetClusterInfo never answers a tenant that is not an admin.

Requests that pass validation are kept tiny (at most 64x64, 9 frames, 2 steps; sequence lengths up to 512), so
that the few that do run cost a fraction of a second. Request streams are sent whole before the answer is read
(an iterator over a finished list): a client still sending when the server ends the call can see INTERNAL
"Internal error from Core" from the grpc client itself (grpc/grpc#36066), which says nothing about the server.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from services.auth import CLUSTER_SECRET_METADATA_KEY
from services.orchestrator.tenants import new_api_key
from services.stage_table import STAGES as STAGE_KINDS
from stagediff import Client
from stagediff.local.supervisor import LocalCluster
from stagediff.status_details import retry_after
from stagediff.tensor_codec import DATATYPES, TensorAssembler, encode_tensor
from stagediff.v1 import generation_pb2, generation_pb2_grpc, image_pb2, stages_pb2, tensor_pb2
from tests.helpers.cluster_pool import ClusterPool
from tests.helpers.grpc_channels import CLUSTER_SECRET, stage_channel
from tests.helpers.tenants_cluster import FUZZ_TENANT_ADMINS, FUZZ_TENANT_QUOTAS, TenantsFile, tenants_cluster

pytestmark = pytest.mark.e2e

Code = grpc.StatusCode
REFUSALS = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.RESOURCE_EXHAUSTED,
        Code.FAILED_PRECONDITION,
        Code.OUT_OF_RANGE,
        Code.PERMISSION_DENIED,
    }
)
ANSWERS = REFUSALS | {Code.OK}
# What a job that this test submitted may end with: its deadline, the cancellation this test asked for, a refusal.
JOB_ENDINGS = ANSWERS | {Code.DEADLINE_EXCEEDED, Code.CANCELLED}
TERMINAL = (
    generation_pb2.JOB_STATE_SUCCEEDED,
    generation_pb2.JOB_STATE_FAILED,
    generation_pb2.JOB_STATE_CANCELLED,
)

CODES = {code.value[0]: code for code in Code}
MIN_CALLS = 1000
MIN_CALLS_WITH_TENANTS = 300
# Status messages are cut to about 1 KiB by the servers; far longer ones could not travel (see Fuzzer.check).
MAX_DETAILS_BYTES = 2048
# A message this large may be refused by grpc itself (RESOURCE_EXHAUSTED, no RetryInfo) before any handler,
# authentication included, sees the call; the strategies' requests stay far below it.
LARGE_BODY_BYTES = 1 << 20
CALL_TIMEOUT_S = 30.0
# Short deadlines that a call may run into: DEADLINE_EXCEEDED is then an answer like any other.
SHORT_TIMEOUTS_S = (0.001, 0.02, 0.2)
MODEL = "tiny"  # the checkpoint directory's name, as the cluster fixture makes it
EMBED_DIM = 32  # text_dim of the tiny preset
LATENT_CHANNELS = 16
MAX_SENT_BYTES = 64 << 10  # tensors whose shape asks for more are sent short, so the server refuses them
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)

# The tenants of the `tenants` run, with their quotas: tests/helpers/tenants_cluster.py.
TENANT_QUOTAS = FUZZ_TENANT_QUOTAS
TENANT_ADMINS = FUZZ_TENANT_ADMINS
TENANT_OUTPUT_FRAMES = {name: quotas["max_output_frames"] for name, quotas in TENANT_QUOTAS.items()}
RATE_LIMITED_TENANT = "zeta"

SERVICES = {
    "orchestrator": generation_pb2.DESCRIPTOR.services_by_name["Generation"],
    "text-encoder": stages_pb2.DESCRIPTOR.services_by_name["TextEncoder"],
    "dit": stages_pb2.DESCRIPTOR.services_by_name["Denoiser"],
    "vae": stages_pb2.DESCRIPTOR.services_by_name["VaeDecoder"],
    "interp": stages_pb2.DESCRIPTOR.services_by_name["Interpolator"],
}
STAGES = ("text-encoder", "dit", "vae", "interp")


def _path(service, method: str) -> str:
    return f"/{service.full_name}/{method}"


def _methods() -> dict[str, tuple[str, str]]:
    """Method path -> (server, kind) for every RPC a server of the cluster implements."""
    methods = {}
    for server, service in SERVICES.items():
        for method in service.methods:
            kind = ("stream" if method.client_streaming else "unary") + "_"
            kind += "stream" if method.server_streaming else "unary"
            methods[_path(service, method.name)] = (server, kind)
    control = stages_pb2.DESCRIPTOR.services_by_name["StageControl"]
    for stage in STAGES:
        methods[f"{_path(control, 'GetStageInfo')}@{stage}"] = (stage, "unary_unary")
    return methods


METHODS = _methods()
GENERATION = {name: _path(SERVICES["orchestrator"], name) for name in SERVICES["orchestrator"].methods_by_name}
ENCODE = _path(SERVICES["text-encoder"], "Encode")
DENOISE = _path(SERVICES["dit"], "Denoise")
DECODE = _path(SERVICES["vae"], "Decode")
INTERPOLATE = _path(SERVICES["interp"], "Interpolate")
STAGE_INFO = _path(stages_pb2.DESCRIPTOR.services_by_name["StageControl"], "GetStageInfo")


# ------------------------------------------------------------------------------------------------- calling --


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[bytes]
    retry_after: float | None = None  # seconds, from a RetryInfo in the status details


def invoke(
    channel: grpc.Channel,
    method: str,
    kind: str,
    payloads: list[bytes],
    *,
    timeout: float = CALL_TIMEOUT_S,
    metadata: tuple[tuple[str, str | bytes], ...] = (),
    cancel_after: int | None = None,
) -> Outcome:
    """One call with raw request bytes; request streams are sent whole, then the answer is read."""
    callable_ = getattr(channel, kind)(method, request_serializer=None, response_deserializer=None)
    request = iter(list(payloads)) if kind.startswith("stream") else payloads[0]
    responses: list[bytes] = []
    try:
        if kind.endswith("unary"):
            responses.append(callable_(request, timeout=timeout, metadata=metadata))
        else:
            call = callable_(request, timeout=timeout, metadata=metadata)
            for response in call:
                responses.append(response)
                if cancel_after is not None and len(responses) >= cancel_after:
                    call.cancel()
    except grpc.RpcError as error:
        return Outcome(error.code(), error.details() or "", responses, retry_after(error))
    return Outcome(Code.OK, "", responses)


def _short(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass
class Fuzzer:
    """The channels, the tally of every call, and the jobs the cluster accepted."""

    orchestrator: grpc.Channel
    stages: dict[str, grpc.Channel]  # with the cluster secret
    bare: dict[str, grpc.Channel]  # without it
    # Tenant -> API key; empty for the open tenant, whose name here is "".
    keys: dict[str, str] = field(default_factory=dict)
    codes: Counter = field(default_factory=Counter)
    accepted: dict[str, str] = field(default_factory=dict)  # job id -> how it was submitted
    owners: dict[str, str] = field(default_factory=dict)  # job id -> the tenant it was accepted for
    # Tenant -> Submit and Generate refusals with RESOURCE_EXHAUSTED and a RetryInfo.
    retry_advised: Counter = field(default_factory=Counter)
    # Lookups (GetJob, WatchJob, CancelJob) by one tenant of another tenant's job.
    cross_tenant_lookups: int = 0
    unknown_key: str = field(default_factory=new_api_key)  # a well-formed key no tenant has

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return f"Fuzzer({sum(self.codes.values())} calls so far)"

    def channel(self, server: str) -> grpc.Channel:
        return self.orchestrator if server == "orchestrator" else self.stages[server]

    def check(self, rpc: str, outcome: Outcome, allowed, request: object) -> None:
        self.codes[rpc, outcome.code.name] += 1
        assert outcome.code in allowed, (
            f"{rpc} answered {outcome.code.name} ({_short(outcome.details)}); allowed: "
            f"{sorted(code.name for code in allowed)}; request: {_short(request)}"
        )
        # The client's own RESOURCE_EXHAUSTED when the server's status message is too long to travel: the
        # status the server meant never arrived.
        assert "metadata size exceeds" not in outcome.details, f"{rpc}: {outcome.details}; request: {_short(request)}"
        assert len(outcome.details.encode()) <= MAX_DETAILS_BYTES, (
            f"{rpc}: a status message of {len(outcome.details.encode())} bytes: {_short(outcome.details)}"
        )
        # No answer quotes a key, valid or not (the middle of it: an altered key differs in its last character).
        for key in (*self.keys.values(), self.unknown_key):
            assert key[8:24] not in outcome.details, f"{rpc} quoted an API key: {_short(outcome.details)}"

    def accept(self, job_id: str, how: str, tenant: str = "") -> None:
        assert job_id, f"{how}: an accepted job has no job_id"
        self.accepted.setdefault(job_id, how)
        owner = self.owners.setdefault(job_id, tenant)
        assert owner == tenant, f"{how}: tenant '{tenant}' was given job {job_id} of tenant '{owner}'"

    def known_job(self, pick: int) -> str:
        ids = sorted(self.accepted)
        return ids[pick % len(ids)] if ids else ""

    def auth(self, tenant: str) -> tuple[tuple[str, str], ...]:
        """The metadata a call of `tenant` carries: its key, or nothing for the open tenant."""
        return (("authorization", f"Bearer {self.keys[tenant]}"),) if tenant else ()

    def others_jobs(self, tenant: str) -> set[str]:
        return {job_id for job_id, owner in self.owners.items() if owner != tenant}

    def credential(self, credential: tuple[str, str]) -> tuple[str | None, tuple[tuple[str, str | bytes], ...]]:
        """(tenant, metadata) for a drawn credential; tenant None: the metadata authenticates no one."""
        form, value = credential
        if form == "key":
            return value, self.auth(value)
        key = self.keys["epsilon"]
        altered = key[:-1] + ("A" if key[-1] != "A" else "B")
        metadata = {
            "no key": (),
            "unknown key": (("authorization", f"Bearer {self.unknown_key}"),),
            "altered key": (("authorization", f"Bearer {altered}"),),
            "key without 'Bearer'": (("authorization", key),),
            "another scheme": (("authorization", f"Basic {key}"),),
            "'Bearer' alone": (("authorization", "Bearer"),),
            "a valid key twice": (("authorization", f"Bearer {key}"),) * 2,
            "a binary header": (("authorization-bin", f"Bearer {key}".encode()),),
            "any value": (("authorization", value),),
        }[form]
        return None, metadata


# ------------------------------------------------------------------------------------------- strategies --

printable = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
# Unicode of every kind (NUL, combining marks, emoji, right-to-left, private use), but no lone surrogates,
# which a protobuf string cannot hold.
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
long_texts = st.builds(
    lambda char, count: char * count,
    st.characters(exclude_categories=("Cs",)),
    st.sampled_from((9_999, 10_000, 10_001, 40_000)),
)
strings = st.one_of(texts, st.sampled_from(("", " ", "\n\t", "\x00", "a fox", "é" * 300)), long_texts)
floats = st.one_of(
    st.sampled_from((math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, 1e308, -1e308, 5e-324, 2.0**64)),
    st.floats(allow_nan=True, allow_infinity=True),
)


def outside(values, valid) -> st.SearchStrategy[int]:
    """Values from `values` that `valid` refuses."""
    return values.filter(lambda value: not valid(value))


INT32_EDGES = (-(2**31), -(2**16), -1, 0, 2**31 - 1, 2**16, 2**24 + 1)


def bad_int32(valid) -> st.SearchStrategy[int]:
    """int32 values that `valid` refuses: the edges of the type first, then any."""
    return st.one_of(outside(st.sampled_from(INT32_EDGES), valid), outside(INT32, valid))


def chance(draw, percent: int) -> bool:
    return draw(st.integers(0, 99)) < percent


@dataclass(frozen=True)
class Field:
    """A request field: cheap values the server must take, and values it must refuse."""

    good: st.SearchStrategy
    bad: st.SearchStrategy

    def draw(self, draw, corrupt_percent: int):
        return draw(self.bad) if chance(draw, corrupt_percent) else draw(self.good)


# How often each field or part of a request is made wrong: a request has many, so most requests are refused for
# one or two reasons, each check gets its turn, and some requests are valid and run.
PUBLIC_CORRUPT_PERCENT = 15
STAGE_CORRUPT_PERCENT = 6

MODELS = Field(
    st.sampled_from(("", MODEL)),
    st.one_of(
        st.sampled_from(("TINY", "tiny ", "../tiny", "no-such-model")), strings.filter(lambda s: s not in ("", MODEL))
    ),
)
SIZES = Field(st.sampled_from((16, 32, 64)), bad_int32(lambda v: 0 < v <= 1920 and v % 16 == 0))
FRAMES = Field(st.sampled_from((1, 5)), bad_int32(lambda v: 1 <= v <= 257 and (v - 1) % 4 == 0))
STEPS = Field(st.sampled_from((1, 2)), bad_int32(lambda v: 1 <= v <= 1000))
GUIDANCE = Field(
    st.one_of(st.sampled_from((0.0, 1.0, 5.0, 100.0)), st.floats(0, 100)), outside(floats, lambda v: 0 <= v <= 100)
)
SEEDS = Field(
    st.one_of(st.sampled_from((0, 2**63 - 1)), st.integers(0, 2**63 - 1)),
    st.one_of(st.sampled_from((-1, -(2**63))), st.integers(-(2**63), -1)),
)
FPS = Field(
    st.one_of(st.sampled_from((16.0, 240.0)), st.floats(0, 240, exclude_min=True)),
    outside(floats, lambda v: 0 < v <= 240),
)
PROMPTS = Field(
    st.one_of(st.just("a fox"), texts.filter(str.strip)),
    st.one_of(st.sampled_from(("", " ", "\n\t")), long_texts.filter(lambda s: len(s) > 10_000)),
)
NEGATIVE_PROMPTS = Field(texts, long_texts.filter(lambda s: len(s) > 10_000))
REQUEST_IDS = Field(
    st.one_of(st.just(""), st.sampled_from(("fuzz-1", "fuzz-2", "fuzz-3")), texts),
    st.text(printable, min_size=129, max_size=300) | long_texts,
)
ALLOWED_SCALES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
INTERP_EXPS = Field(st.integers(0, 4), bad_int32(lambda v: 0 <= v <= 4))
INTERP_SCALES = Field(st.sampled_from(ALLOWED_SCALES), outside(floats, lambda v: v in ALLOWED_SCALES))
INTERP_MODEL_PATHS = Field(
    st.just(""), st.one_of(st.sampled_from(("/etc/passwd", "flownet.pkl")), strings.filter(bool))
)
SEQUENCE_LENGTHS = Field(
    # Up to 512 tokens: the longest sequences (2048) cost seconds on one CPU thread.
    st.one_of(st.sampled_from((0, 1, 512)), st.integers(1, 64)),
    bad_int32(lambda v: 0 <= v <= 2048),
)
# Deadlines: mostly the generous one, sometimes one the call may well run into.
timeouts = st.sampled_from((CALL_TIMEOUT_S,) * 3 + SHORT_TIMEOUTS_S)

metadata_keys = st.one_of(
    st.sampled_from(("traceparent", "tracestate", "authorization", "x-request-id", "baggage")),
    st.from_regex(r"x-[a-z0-9_.-]{1,12}", fullmatch=True).filter(lambda key: not key.endswith("-bin")),
)
traceparents = st.builds(
    lambda version, trace, span, flags: f"{version}-{trace}-{span}-{flags}",
    st.sampled_from(("00", "ff", "01", "zz")),
    st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
    st.from_regex(r"[0-9a-f]{16}", fullmatch=True),
    st.sampled_from(("00", "01", "ff", "x")),
)
metadata = st.lists(
    st.one_of(
        st.tuples(metadata_keys, st.text(printable, max_size=60)),
        st.tuples(st.just("traceparent"), traceparents),
        st.tuples(st.just("x-fuzz-bin"), st.binary(max_size=40)),
    ),
    max_size=3,
).map(tuple)


def _small_png() -> bytes:
    from io import BytesIO

    from PIL import Image

    buffer = BytesIO()
    Image.fromarray(np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)).save(buffer, format="PNG")
    return buffer.getvalue()


SMALL_PNG = _small_png()
# Input images: a valid one, random bytes, a PNG with bytes changed or cut; any role, known or not.
input_images = st.lists(
    st.builds(
        lambda data, role: image_pb2.InputImage(data=data, role=role),
        st.one_of(st.just(SMALL_PNG), st.binary(max_size=64), st.deferred(lambda: mangled(SMALL_PNG))),
        st.one_of(st.integers(0, 3), INT32),
    ),
    min_size=1,
    max_size=5,
)


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    """A GenerateRequest whose fields are cheap and valid, unset (the model's default), or wrong: out of range,
    NaN or infinite, empty, huge, any unicode."""
    corrupt = PUBLIC_CORRUPT_PERCENT
    request = generation_pb2.GenerateRequest(
        model=MODELS.draw(draw, corrupt),
        prompt=PROMPTS.draw(draw, corrupt),
        negative_prompt=NEGATIVE_PROMPTS.draw(draw, corrupt),
        request_id=REQUEST_IDS.draw(draw, corrupt),
    )
    for name, values in (
        ("height", SIZES),
        ("width", SIZES),
        ("num_frames", FRAMES),
        ("num_inference_steps", STEPS),
        ("guidance_scale", GUIDANCE),
        ("seed", SEEDS),
        ("fps", FPS),
    ):
        if not chance(draw, 25):  # else unset: the model's default
            setattr(request, name, values.draw(draw, corrupt))
    if chance(draw, 20):
        request.images.extend(draw(input_images))
    if draw(st.booleans()):
        request.interpolation.enable = draw(st.booleans())
        request.interpolation.exp = INTERP_EXPS.draw(draw, corrupt)
        request.interpolation.scale = INTERP_SCALES.draw(draw, corrupt)
        request.interpolation.model_path = INTERP_MODEL_PATHS.draw(draw, corrupt)
    return request


# A request that is valid and costs almost nothing: the base that byte mutations start from.
CHEAP_REQUEST = generation_pb2.GenerateRequest(
    prompt="a fox", height=32, width=32, num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=1
)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def mangled(draw, base: bytes) -> bytes:
    """`base` with a few bytes changed, cut, inserted, or with unknown and broken fields appended."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 3))):
        operation = draw(st.sampled_from(("replace", "cut", "insert", "unknown field", "broken field")))
        if operation == "replace" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif operation == "cut":
            data = data[: draw(st.integers(0, len(data)))]
        elif operation == "insert":
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif operation == "unknown field":
            number = draw(st.integers(16, 2**29 - 1))
            data += _varint(number << 3) + _varint(draw(st.integers(0, 2**64 - 1)))
        else:  # field number 0, a wire type that does not exist, or a length running past the end
            data += draw(st.sampled_from((b"\x00\x01", b"\x0f", b"\x0e\x00", b"\x12\xff\xff\xff\x0f", b"\x12\x05ab")))
    return bytes(data)


def raw_bodies(base: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=200), mangled(base))


@dataclass(frozen=True)
class KnownJob:
    """Stands for one of the jobs accepted so far (resolved when the call is made)."""

    pick: int


job_ids = st.one_of(
    strings,
    st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
    st.builds(KnownJob, st.integers(0, 1000)),
)

# ------------------------------------------------------------------------------------------------ tensors --

ITEMSIZE = {"BOOL": 1, "UINT8": 1, "INT8": 1, "INT16": 2, "INT32": 4, "INT64": 8, "FP16": 2, "BF16": 2}
ITEMSIZE |= {"FP32": 4, "FP64": 8}
EDGE_DIMS = (-1, -(2**63), 2**31, 2**40, 2**62, 2**63 - 1)
any_dim = st.one_of(st.integers(0, 24), st.sampled_from(EDGE_DIMS))
tensor_names = st.one_of(
    st.sampled_from(("prompt_embeds", "negative_prompt_embeds", "prompt_embeds_mask", "latents", "frames", "")),
    strings,
)
datatypes = st.one_of(st.sampled_from(DATATYPES), st.sampled_from(("", "fp32", "FP4", "BYTES", "UINT16")), strings)
DEFECTS = (
    "short",
    "long",
    "offset",
    "no header",
    "second header",
    "not last",
    "early last",
    "dropped chunk",
    "repeated chunk",
)


def wrong_shapes(shape: tuple[int, ...]) -> st.SearchStrategy[tuple[int, ...]]:
    """`shape` with one dimension changed, a shape of any rank, or one with too many dimensions."""
    one_changed = st.tuples(st.integers(0, len(shape) - 1), any_dim).map(
        lambda change: shape[: change[0]] + (change[1],) + shape[change[0] + 1 :]
    )
    return st.one_of(one_changed, st.lists(any_dim, max_size=6).map(tuple), st.integers(33, 70).map(lambda n: (1,) * n))


def _fill(kind: str, length: int, datatype: str, seed: int) -> bytes:
    if kind == "zeros":
        return bytes(length)
    if kind == "ones":
        return b"\xff" * length
    if kind == "specials" and datatype in ("FP16", "FP32", "FP64"):
        dtype = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}[datatype]
        values = np.resize(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30], dtype=np.float64), length)
        with np.errstate(over="ignore"):
            return values.astype(dtype).tobytes()[:length]
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes()


@st.composite
def tensor_chunks(
    draw, name: str, allowed_types: tuple[str, ...], shape: tuple[int, ...], index: int, corrupt: int
) -> list[tensor_pb2.TensorChunk]:
    """One tensor's chunks, as a stage expects them, with `corrupt` percent chance for each part to be wrong:
    its name, datatype, shape or index, or the chunks themselves (bad offset, missing header, cut short, ...).
    The values are zeros, random bytes, NaN and infinities, or all bits set."""
    name = draw(tensor_names) if chance(draw, corrupt) else name
    datatype = draw(datatypes) if chance(draw, corrupt) else draw(st.sampled_from(allowed_types))
    shape = draw(wrong_shapes(shape)) if chance(draw, corrupt) else shape
    index = draw(INT64) if chance(draw, corrupt) else index
    size = math.prod(shape) * ITEMSIZE.get(datatype, 1) if min(shape, default=0) >= 0 else -1
    length = size if 0 <= size <= MAX_SENT_BYTES else draw(st.integers(0, 64))
    fill = draw(st.sampled_from(("zeros", "random", "specials", "ones")))
    data = _fill(fill, length, datatype, draw(st.integers(0, 2**32 - 1)))
    defect = draw(st.sampled_from(DEFECTS)) if chance(draw, corrupt) else "none"
    if defect == "short":
        data = data[:-1]
    elif defect == "long":
        data += b"\x01"
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    bounds = [0, *cuts, len(data)]
    chunks = [
        tensor_pb2.TensorChunk(offset=start, data=data[start:end])
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    chunks[0].header.CopyFrom(tensor_pb2.TensorHeader(name=name, datatype=datatype, shape=shape, index=index))
    chunks[-1].last = True
    at = draw(st.integers(0, len(chunks) - 1))
    if defect == "offset":
        chunks[at].offset = draw(st.one_of(st.integers(-3, len(data) + 3), INT64))
    elif defect == "no header":
        chunks[0].ClearField("header")
    elif defect == "second header":
        extra = tensor_pb2.TensorChunk(offset=len(data), last=True)
        extra.header.CopyFrom(chunks[0].header)
        chunks.insert(at + 1, extra)
    elif defect == "not last":
        chunks[-1].last = False
    elif defect == "early last":
        chunks[at].last = True
    elif defect == "dropped chunk" and len(chunks) > 1:
        del chunks[at]
    elif defect == "repeated chunk":
        chunks.insert(at, chunks[at])
    return chunks


def _stream(draw, request_type, params, tensors: list[list[tensor_pb2.TensorChunk]], corrupt: int) -> list[bytes]:
    """Params first, then the tensors; or, `corrupt` percent of the time, the messages out of order, params twice
    or missing, an empty message, a tensor too many, or bytes that are no message at all."""
    first = request_type(params=params)
    parts = [request_type(tensor=chunk) for chunks in tensors for chunk in chunks]
    messages = [first, *parts]
    if chance(draw, corrupt):
        layout = draw(st.sampled_from(("no params", "params twice", "params last", "empty message", "extra tensor")))
        if layout == "no params":
            messages = parts
        elif layout == "params twice":
            messages = [first, first, *parts]
        elif layout == "params last":
            messages = [*parts, first]
        elif layout == "empty message":
            messages.insert(draw(st.integers(0, len(messages))), request_type())
        else:
            extra = draw(tensor_chunks(draw(tensor_names), DATATYPES, (1, 4), 0, 50))
            messages += [request_type(tensor=chunk) for chunk in extra]
    payloads = [message.SerializeToString() for message in messages]
    if chance(draw, corrupt):
        payloads.insert(draw(st.integers(0, len(payloads))), draw(st.binary(min_size=1, max_size=60)))
    return payloads or [b""]


EMBEDDING_TYPES = ("FP32", "BF16", "FP16")


@st.composite
def denoise_streams(draw) -> list[bytes]:
    corrupt = STAGE_CORRUPT_PERCENT
    params = stages_pb2.DenoiseParams(
        model=MODELS.draw(draw, corrupt),
        height=SIZES.draw(draw, corrupt),
        width=SIZES.draw(draw, corrupt),
        num_frames=FRAMES.draw(draw, corrupt),
        num_inference_steps=STEPS.draw(draw, corrupt),
        guidance_scale=GUIDANCE.draw(draw, corrupt),
        seed=SEEDS.draw(draw, corrupt),
    )
    names = ["prompt_embeds"]
    # The negative prompt's embeddings are needed with CFG (guidance_scale > 1), and allowed (unused) without.
    if params.guidance_scale > 1 or draw(st.booleans()):
        names.append("negative_prompt_embeds")
    if chance(draw, corrupt):
        names = draw(st.lists(st.sampled_from(("prompt_embeds", "negative_prompt_embeds")), max_size=3))
    tensors = [
        draw(tensor_chunks(name, EMBEDDING_TYPES, (1, draw(st.integers(1, 16)), EMBED_DIM), 0, corrupt))
        for name in names
    ]
    return _stream(draw, stages_pb2.DenoiseRequest, params, tensors, corrupt)


MAX_LATENT_FRAMES = 65  # (257 - 1) // 4 + 1 for the tiny model


@st.composite
def decode_streams(draw) -> list[bytes]:
    corrupt = STAGE_CORRUPT_PERCENT
    frames = Field(st.integers(1, 3), bad_int32(lambda v: 1 <= v <= MAX_LATENT_FRAMES)).draw(draw, corrupt)
    params = stages_pb2.DecodeParams(model=MODELS.draw(draw, corrupt), num_latent_frames=frames)
    sent = frames if 1 <= frames <= 3 else draw(st.integers(0, 3))
    if chance(draw, corrupt):
        sent = draw(st.integers(0, 4))
    shape = (1, LATENT_CHANNELS, 1, draw(st.integers(1, 8)), draw(st.integers(1, 8)))
    tensors = [draw(tensor_chunks("latents", EMBEDDING_TYPES, shape, t, corrupt)) for t in range(sent)]
    return _stream(draw, stages_pb2.DecodeRequest, params, tensors, corrupt)


@st.composite
def interpolate_streams(draw) -> list[bytes]:
    corrupt = STAGE_CORRUPT_PERCENT
    params = stages_pb2.InterpolateParams(
        exp=INTERP_EXPS.draw(draw, corrupt),
        scale=INTERP_SCALES.draw(draw, corrupt),
        model_path=INTERP_MODEL_PATHS.draw(draw, corrupt),
    )
    # Frames smaller than 16 pixels are averaged, larger ones go through optical flow.
    height, width = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    tensors = [
        draw(tensor_chunks("frames", ("UINT8",), (draw(st.integers(1, 3)), height, width, 3), 0, corrupt))
        for _ in range(draw(st.integers(0, 3)))
    ]
    return _stream(draw, stages_pb2.InterpolateRequest, params, tensors, corrupt)


@st.composite
def encode_requests(draw) -> stages_pb2.EncodeRequest:
    corrupt = PUBLIC_CORRUPT_PERCENT
    texts_ = Field(
        st.lists(st.one_of(st.just("a fox"), texts), min_size=1, max_size=8),
        st.one_of(st.just([]), st.lists(texts, min_size=9, max_size=12), st.lists(long_texts, min_size=1, max_size=2)),
    )
    return stages_pb2.EncodeRequest(
        model=MODELS.draw(draw, corrupt),
        texts=texts_.draw(draw, corrupt),
        max_sequence_length=SEQUENCE_LENGTHS.draw(draw, corrupt),
    )


def _tensor_stream(request_type, params, *tensors) -> list[bytes]:
    messages = [request_type(params=params)]
    for name, value in tensors:
        messages += [request_type(tensor=chunk) for chunk in encode_tensor(name, value)]
    return [message.SerializeToString() for message in messages]


# Valid, cheap stage requests: the bases that byte mutations start from.
CHEAP_STAGE_STREAMS = {
    DENOISE: _tensor_stream(
        stages_pb2.DenoiseRequest,
        stages_pb2.DenoiseParams(height=16, width=16, num_frames=1, num_inference_steps=1, guidance_scale=1.0),
        ("prompt_embeds", np.zeros((1, 4, EMBED_DIM), np.float32)),
    ),
    DECODE: _tensor_stream(
        stages_pb2.DecodeRequest,
        stages_pb2.DecodeParams(num_latent_frames=1),
        ("latents", np.zeros((1, LATENT_CHANNELS, 1, 2, 2), np.float32)),
    ),
    INTERPOLATE: _tensor_stream(
        stages_pb2.InterpolateRequest,
        stages_pb2.InterpolateParams(exp=1),
        ("frames", np.zeros((2, 4, 4, 3), np.uint8)),
    ),
    ENCODE: [stages_pb2.EncodeRequest(texts=["a fox"]).SerializeToString()],
    # The orchestrator's one request stream: an image file's chunks.
    GENERATION["UploadImage"]: [image_pb2.ImageUploadChunk(data=b"\x89PNG\r\n\x1a\n" + bytes(64)).SerializeToString()],
}


def _announced(shape: tuple[int, ...]) -> list[bytes]:
    """Cheap valid DiT params, then a tensor header announcing `shape` with no data."""
    header = tensor_pb2.TensorHeader(name="prompt_embeds", datatype="FP32", shape=shape)
    return [
        CHEAP_STAGE_STREAMS[DENOISE][0],
        stages_pb2.DenoiseRequest(tensor=tensor_pb2.TensorChunk(header=header, last=True)).SerializeToString(),
    ]


CHEAP_BODIES = {
    GENERATION["Generate"]: CHEAP_REQUEST.SerializeToString(),
    GENERATION["Submit"]: CHEAP_REQUEST.SerializeToString(),
    GENERATION["GetJob"]: generation_pb2.GetJobRequest(job_id="0" * 32).SerializeToString(),
    GENERATION["WatchJob"]: generation_pb2.WatchJobRequest(job_id="0" * 32).SerializeToString(),
    GENERATION["CancelJob"]: generation_pb2.CancelJobRequest(job_id="0" * 32).SerializeToString(),
    GENERATION["ListJobs"]: generation_pb2.ListJobsRequest(state=3, limit=5).SerializeToString(),
}

# ----------------------------------------------------------------------------------------------- fuzzers --

# Each fuzzer's max_examples is its budget: the counts keep the open run at about 1,350 calls (over MIN_CALLS,
# every RPC drawn with each of its checks) and the tenants run at about 350. A budget in examples, not in time,
# makes the same calls on a slower machine rather than fewer. The draws are derandomized: the checks that each
# stage RPC saw valid requests among the random ones hold for a fixed set of draws, never by chance (one random
# run in many drew no valid TextEncoder.Encode request in its 90).
SETTINGS = dict(
    deadline=None,
    database=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
    suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much),
)


def _events(outcome: Outcome) -> list[generation_pb2.GenerateEvent]:
    return [generation_pb2.GenerateEvent.FromString(response) for response in outcome.responses]


def _check_refusal_advice(fuzzer: Fuzzer, rpc: str, outcome: Outcome, body: bytes, tenant: str) -> None:
    """A Submit or Generate refused for load (a spent rate, a full queue) says when to retry."""
    if outcome.code != Code.RESOURCE_EXHAUSTED or len(body) >= LARGE_BODY_BYTES:
        return
    assert outcome.retry_after is not None and outcome.retry_after > 0, (
        f"{rpc}: RESOURCE_EXHAUSTED without a RetryInfo ({_short(outcome.details)})"
    )
    fuzzer.retry_advised[tenant] += 1


def _check_output_frames(fuzzer: Fuzzer, rpc: str, frames: int, tenant: str) -> None:
    limit = TENANT_OUTPUT_FRAMES.get(tenant) if tenant else None
    assert limit is None or frames <= limit, f"{rpc}: tenant '{tenant}' got a job of {frames} frames (limit {limit})"


def _output_frames(request: generation_pb2.GenerateRequest) -> int:
    exp = request.interpolation.exp if request.interpolation.enable and request.interpolation.exp > 0 else 0
    return (request.num_frames - 1) * 2**exp + 1


def _generate(
    fuzzer: Fuzzer, rpc: str, body: bytes, request: object, timeout: float, meta, cancel: bool, tenant: str = ""
) -> None:
    outcome = invoke(
        fuzzer.orchestrator,
        GENERATION["Generate"],
        "unary_stream",
        [body],
        timeout=timeout,
        metadata=meta,
        cancel_after=1 if cancel else None,
    )
    events = _events(outcome)
    allowed = set(REFUSALS)
    if events:  # admitted: it runs to the end, unless its deadline or this test's cancel ends it first
        fuzzer.accept(events[0].job_id, rpc, tenant)
        allowed |= JOB_ENDINGS
    else:
        _check_refusal_advice(fuzzer, rpc, outcome, body, tenant)
    if timeout < CALL_TIMEOUT_S:
        allowed.add(Code.DEADLINE_EXCEEDED)
    if cancel:
        allowed.add(Code.CANCELLED)
    if outcome.code == Code.OK:
        assert events[-1].HasField("completed"), f"{rpc}: OK without a 'completed' event; request: {_short(request)}"
        _check_output_frames(fuzzer, rpc, events[-1].completed.num_frames, tenant)
    fuzzer.check(rpc, outcome, allowed, request)


def _submit(fuzzer: Fuzzer, rpc: str, body: bytes, request: object, timeout: float, meta, tenant: str = "") -> None:
    outcome = invoke(fuzzer.orchestrator, GENERATION["Submit"], "unary_unary", [body], timeout=timeout, metadata=meta)
    allowed = ANSWERS | ({Code.DEADLINE_EXCEEDED} if timeout < CALL_TIMEOUT_S else set())
    fuzzer.check(rpc, outcome, allowed, request)
    _check_refusal_advice(fuzzer, rpc, outcome, body, tenant)
    if outcome.code == Code.OK:
        job = generation_pb2.Job.FromString(outcome.responses[0])
        fuzzer.accept(job.job_id, rpc, tenant)
        assert job.state != generation_pb2.JOB_STATE_UNSPECIFIED, f"{rpc}: job {job.job_id} has no state"
        _check_output_frames(fuzzer, rpc, _output_frames(job.request), tenant)


@settings(max_examples=120, **SETTINGS)
@given(request=generate_requests(), timeout=timeouts, meta=metadata, cancel=st.integers(0, 9).map(lambda i: i == 0))
@example(request=CHEAP_REQUEST, timeout=CALL_TIMEOUT_S, meta=(), cancel=False)
@example(request=CHEAP_REQUEST, timeout=CALL_TIMEOUT_S, meta=(), cancel=True)
def fuzz_generate(fuzzer: Fuzzer, request, timeout, meta, cancel) -> None:
    _generate(fuzzer, "Generate", request.SerializeToString(), request, timeout, meta, cancel)


@settings(max_examples=150, **SETTINGS)
@given(request=generate_requests(), timeout=timeouts, meta=metadata)
@example(request=CHEAP_REQUEST, timeout=CALL_TIMEOUT_S, meta=())
# A model name longer than a status message can quote.
@example(request=generation_pb2.GenerateRequest(prompt="a fox", model="m" * 40_000), timeout=CALL_TIMEOUT_S, meta=())
# Larger than any server takes (64 MiB): refused before it is parsed.
@example(request=generation_pb2.GenerateRequest(prompt="x" * (65 << 20)), timeout=CALL_TIMEOUT_S, meta=())
def fuzz_submit(fuzzer: Fuzzer, request, timeout, meta) -> None:
    _submit(fuzzer, "Submit", request.SerializeToString(), request, timeout, meta)


@settings(max_examples=120, **SETTINGS)
@given(rpc=st.sampled_from(("GetJob", "WatchJob", "CancelJob")), job_id=job_ids, timeout=timeouts, meta=metadata)
# A job id longer than a status message can quote.
@example(rpc="GetJob", job_id="x" * 40_000, timeout=CALL_TIMEOUT_S, meta=())
def fuzz_job_lookups(fuzzer: Fuzzer, rpc, job_id, timeout, meta) -> None:
    _lookup(fuzzer, rpc, job_id, timeout, meta)


def _lookup(fuzzer: Fuzzer, rpc: str, job_id, timeout: float, meta, tenant: str = "", label: str = "") -> None:
    """GetJob, WatchJob or CancelJob: a job of the caller's is found; any other id, another tenant's job
    included, is NOT_FOUND."""
    if isinstance(job_id, KnownJob):
        job_id = fuzzer.known_job(job_id.pick)
    request = getattr(generation_pb2, f"{rpc}Request")(job_id=job_id)
    kind = "unary_stream" if rpc == "WatchJob" else "unary_unary"
    outcome = invoke(
        fuzzer.orchestrator, GENERATION[rpc], kind, [request.SerializeToString()], timeout=timeout, metadata=meta
    )
    mine = fuzzer.owners.get(job_id) == tenant
    allowed = set(JOB_ENDINGS if mine else ANSWERS)
    if timeout < CALL_TIMEOUT_S:
        allowed.add(Code.DEADLINE_EXCEEDED)
    fuzzer.check(rpc + label, outcome, allowed, request)
    if job_id in fuzzer.owners and not mine:
        fuzzer.cross_tenant_lookups += 1
        # Another tenant's job is as unknown as one that never existed.
        assert outcome.code == Code.NOT_FOUND or timeout < CALL_TIMEOUT_S, (
            f"{rpc}{label} answered {outcome.code.name} for tenant '{fuzzer.owners[job_id]}''s job {job_id}"
        )
    elif not mine:
        # An id no job has: NOT_FOUND, or INVALID_ARGUMENT naming job_id for one no job could have.
        refused = outcome.code == Code.NOT_FOUND or (
            outcome.code == Code.INVALID_ARGUMENT and outcome.details.startswith("job_id")
        )
        assert refused or timeout < CALL_TIMEOUT_S, (
            f"{rpc}{label} answered {outcome.code.name} ({_short(outcome.details)}) for an unknown job {_short(job_id)}"
        )
    elif outcome.code == Code.OK and rpc != "WatchJob":
        assert generation_pb2.Job.FromString(outcome.responses[0]).job_id == job_id


@settings(max_examples=50, **SETTINGS)
@given(
    state=st.one_of(st.integers(0, 5), INT32),
    limit=st.one_of(st.integers(0, 1000), st.sampled_from((-1, 1001, -(2**31), 2**31 - 1)), INT32),
    meta=metadata,
)
def fuzz_list_jobs(fuzzer: Fuzzer, state, limit, meta) -> None:
    _list_jobs(fuzzer, state, limit, meta)


def _list_jobs(fuzzer: Fuzzer, state: int, limit: int, meta, tenant: str = "", label: str = "") -> None:
    request = generation_pb2.ListJobsRequest(state=state, limit=limit)
    outcome = invoke(
        fuzzer.orchestrator, GENERATION["ListJobs"], "unary_unary", [request.SerializeToString()], metadata=meta
    )
    fuzzer.check("ListJobs" + label, outcome, ANSWERS, request)
    valid = 0 <= state <= 5 and 0 <= limit <= 1000
    assert (outcome.code == Code.OK) == valid, f"ListJobs({state=}, {limit=}) answered {outcome.code.name}"
    if valid:
        jobs = generation_pb2.ListJobsResponse.FromString(outcome.responses[0]).jobs
        assert len(jobs) <= (limit or 100)
        assert state == 0 or all(job.state == state for job in jobs), f"ListJobs(state={state}) listed other states"
        others = {job.job_id for job in jobs} & fuzzer.others_jobs(tenant)
        assert not others, f"ListJobs{label} listed other tenants' jobs: {sorted(others)}"


@settings(max_examples=30, **SETTINGS)
@given(rpc=st.sampled_from(("ListModels", "GetClusterInfo")), body=st.one_of(st.just(b""), mangled(b"")), meta=metadata)
def fuzz_cluster_queries(fuzzer: Fuzzer, rpc, body, meta) -> None:
    _cluster_query(fuzzer, rpc, body, meta)


def _cluster_query(fuzzer: Fuzzer, rpc: str, body: bytes, meta, tenant: str = "", label: str = "") -> None:
    outcome = invoke(fuzzer.orchestrator, GENERATION[rpc], "unary_unary", [body], metadata=meta)
    fuzzer.check(rpc + label, outcome, ANSWERS, body)
    if rpc == "GetClusterInfo" and tenant and tenant not in TENANT_ADMINS:
        assert outcome.code != Code.OK, f"GetClusterInfo answered tenant '{tenant}', which is not an admin"
    if outcome.code == Code.OK and rpc == "ListModels":
        models_ = generation_pb2.ListModelsResponse.FromString(outcome.responses[0]).models
        assert [model.id for model in models_] == [MODEL]
    elif outcome.code == Code.OK:
        info = generation_pb2.ClusterInfo.FromString(outcome.responses[0])
        assert [stage.info.stage for stage in info.stages] == list(STAGES)
        assert all(stage.replicas for stage in info.stages), info


@settings(max_examples=90, **SETTINGS)
@given(request=encode_requests(), meta=metadata)
def fuzz_encode(fuzzer: Fuzzer, request, meta) -> None:
    outcome = invoke(
        fuzzer.stages["text-encoder"], ENCODE, "unary_stream", [request.SerializeToString()], metadata=meta
    )
    fuzzer.check("TextEncoder.Encode", outcome, ANSWERS, request)
    if outcome.code == Code.OK:
        # One tensor per text, named as the DiT takes it: the prompt's, then the negative prompt's.
        assembler = TensorAssembler()
        tensors = [assembler.feed(stages_pb2.EncodeResponse.FromString(r).tensor) for r in outcome.responses]
        embeds = [tensor for tensor in tensors if tensor is not None]
        names = ["prompt_embeds", "negative_prompt_embeds"][: len(request.texts)]
        assert [tensor.name for tensor in embeds] == names, [tensor.name for tensor in embeds]
        length = request.max_sequence_length or 512
        assert all(tensor.shape == (1, length, EMBED_DIM) for tensor in embeds), [t.shape for t in embeds]


def _stage_stream(fuzzer: Fuzzer, rpc: str, stage: str, method: str, payloads: list[bytes], meta) -> None:
    outcome = invoke(fuzzer.stages[stage], method, "stream_stream", payloads, metadata=meta)
    fuzzer.check(rpc, outcome, ANSWERS, payloads)


@settings(max_examples=180, **SETTINGS)
@given(payloads=denoise_streams(), meta=metadata)
@example(payloads=CHEAP_STAGE_STREAMS[DENOISE], meta=())
# Shapes no array can have: empty, but with dimensions beyond any size; more dimensions than numpy takes.
@example(payloads=_announced((0, 2**62, 2**62)), meta=())
@example(payloads=_announced((1,) * 65), meta=())
def fuzz_denoise(fuzzer: Fuzzer, payloads, meta) -> None:
    _stage_stream(fuzzer, "Denoiser.Denoise", "dit", DENOISE, payloads, meta)


@settings(max_examples=150, **SETTINGS)
@given(payloads=decode_streams(), meta=metadata)
@example(payloads=CHEAP_STAGE_STREAMS[DECODE], meta=())
def fuzz_decode(fuzzer: Fuzzer, payloads, meta) -> None:
    _stage_stream(fuzzer, "VaeDecoder.Decode", "vae", DECODE, payloads, meta)


@settings(max_examples=150, **SETTINGS)
@given(payloads=interpolate_streams(), meta=metadata)
@example(payloads=CHEAP_STAGE_STREAMS[INTERPOLATE], meta=())
# One message larger than any server takes (64 MiB).
@example(
    payloads=[
        stages_pb2.InterpolateRequest(params=stages_pb2.InterpolateParams(exp=1)).SerializeToString(),
        stages_pb2.InterpolateRequest(tensor=tensor_pb2.TensorChunk(data=bytes(65 << 20))).SerializeToString(),
    ],
    meta=(),
)
def fuzz_interpolate(fuzzer: Fuzzer, payloads, meta) -> None:
    _stage_stream(fuzzer, "Interpolator.Interpolate", "interp", INTERPOLATE, payloads, meta)


@settings(max_examples=25, **SETTINGS)
@given(stage=st.sampled_from(STAGES), body=st.one_of(st.just(b""), mangled(b"")), meta=metadata)
def fuzz_stage_info(fuzzer: Fuzzer, stage, body, meta) -> None:
    outcome = invoke(fuzzer.stages[stage], STAGE_INFO, "unary_unary", [body], metadata=meta)
    fuzzer.check("StageControl.GetStageInfo", outcome, ANSWERS, body)
    if outcome.code == Code.OK:
        info = stages_pb2.StageInfo.FromString(outcome.responses[0])
        # The interpolator does not read the diffusers checkpoint: its weights are its own.
        assert (info.stage, info.model) == (stage, MODEL if STAGE_KINDS[stage].reads_checkpoint else "")


HEALTH_NAMES = ("", "grpc.health.v1.Health", *(service.full_name for service in SERVICES.values()))


@settings(max_examples=25, **SETTINGS)
@given(server=st.sampled_from(("orchestrator", *STAGES)), service=st.one_of(st.sampled_from(HEALTH_NAMES), strings))
def fuzz_health(fuzzer: Fuzzer, server, service) -> None:
    request = health_pb2.HealthCheckRequest(service=service)
    outcome = invoke(
        fuzzer.channel(server), "/grpc.health.v1.Health/Check", "unary_unary", [request.SerializeToString()]
    )
    fuzzer.check("Health.Check", outcome, {Code.OK, Code.NOT_FOUND}, request)
    if outcome.code == Code.OK:
        status = health_pb2.HealthCheckResponse.FromString(outcome.responses[0]).status
        assert status == health_pb2.HealthCheckResponse.SERVING, f"{server} health({service!r}) is {status}"


STAGE_METHODS = sorted(method for method, (server, _) in METHODS.items() if server != "orchestrator")


@settings(max_examples=35, **SETTINGS)
@given(
    method=st.sampled_from(STAGE_METHODS),
    body=st.binary(max_size=100),
    secret=st.one_of(
        st.none(),
        st.text(printable, min_size=1, max_size=40).filter(lambda value: value != CLUSTER_SECRET),
        st.just((CLUSTER_SECRET, CLUSTER_SECRET)),
        st.just((CLUSTER_SECRET, "wrong")),
    ),
)
def fuzz_without_the_secret(fuzzer: Fuzzer, method, body, secret) -> None:
    """A stage call without the cluster secret (or with a wrong one, or two) is refused before anything else."""
    stage, kind = METHODS[method]
    if secret is None:
        meta = ()
    elif isinstance(secret, tuple):
        meta = tuple((CLUSTER_SECRET_METADATA_KEY, value) for value in secret)
    else:
        meta = ((CLUSTER_SECRET_METADATA_KEY, secret),)
    outcome = invoke(fuzzer.bare[stage], method.partition("@")[0], kind, [body], metadata=meta)
    fuzzer.check(f"{method} without the secret", outcome, {Code.UNAUTHENTICATED}, (body, meta))


UNKNOWN_METHODS = (
    "/stagediff.v1.Generation/Nope",
    "/stagediff.v1.Denoiser/Generate",
    "/stagediff.v1.Generation/Denoise",
    "/grpc.health.v1.Health/Nope",
    "/nope/nope",
)


@settings(max_examples=180, **SETTINGS)
@given(
    method=st.sampled_from(sorted(METHODS)),
    data=st.data(),
    timeout=timeouts,
)
def fuzz_raw_bytes(fuzzer: Fuzzer, method, data, timeout) -> None:
    """Random bytes, or a valid request with bytes changed, as the body of every method."""
    server, kind = METHODS[method]
    path = method.partition("@")[0]
    if kind.startswith("stream"):
        bases = CHEAP_STAGE_STREAMS[path]
        payloads = data.draw(
            st.lists(st.one_of(st.binary(max_size=100), *(mangled(b) for b in bases)), min_size=1, max_size=4)
        )
    else:
        payloads = [data.draw(raw_bodies(CHEAP_BODIES.get(path, CHEAP_STAGE_STREAMS.get(path, [b""])[0])))]
    rpc = f"{path.rpartition('/')[2]} (raw bytes)"
    if path == GENERATION["Generate"]:
        _generate(fuzzer, rpc, payloads[0], payloads[0], timeout, (), cancel=False)
    elif path == GENERATION["Submit"]:
        _submit(fuzzer, rpc, payloads[0], payloads[0], timeout, ())
    else:
        outcome = invoke(fuzzer.channel(server), path, kind, payloads, timeout=timeout)
        allowed = JOB_ENDINGS if path == GENERATION["WatchJob"] else set(ANSWERS)
        fuzzer.check(
            rpc, outcome, allowed | ({Code.DEADLINE_EXCEEDED} if timeout < CALL_TIMEOUT_S else set()), payloads
        )


@settings(max_examples=12, **SETTINGS)
@given(method=st.sampled_from(UNKNOWN_METHODS), server=st.sampled_from(("orchestrator", *STAGES)), body=st.binary())
def fuzz_unknown_methods(fuzzer: Fuzzer, method, server, body) -> None:
    outcome = invoke(fuzzer.channel(server), method, "unary_unary", [body])
    fuzzer.check("an unknown method", outcome, {Code.UNIMPLEMENTED}, (method, body))


# ------------------------------------------------------------------------------------------------ tenants --

PUBLIC_RPCS = ("Generate", "Submit", "WatchJob", "GetJob", "CancelJob", "ListJobs", "ListModels", "GetClusterInfo")
INVALID_CREDENTIALS = (
    "no key",
    "unknown key",
    "altered key",
    "key without 'Bearer'",
    "another scheme",
    "'Bearer' alone",
    "a valid key twice",
    "a binary header",
)


@st.composite
def credentials(draw) -> tuple[str, str]:
    """(form, value): about half the time a tenant's key (zeta's less often: its rate is soon spent), else
    metadata that authenticates no one, sometimes any printable value as the authorization header."""
    if chance(draw, 50):
        return "key", "zeta" if chance(draw, 30) else "epsilon"
    if chance(draw, 20):
        return "any value", draw(st.text(printable, max_size=60))
    return draw(st.sampled_from(INVALID_CREDENTIALS)), ""


@dataclass(frozen=True)
class OthersJob:
    """Stands for one of the jobs accepted so far for a tenant other than the caller (resolved at the call)."""

    pick: int


@dataclass(frozen=True)
class PublicCall:
    """A call of a Generation method: `payload` is a GenerateRequest or raw bytes (Generate, Submit), a job id,
    KnownJob or OthersJob (GetJob, WatchJob, CancelJob), (state, limit) (ListJobs), or the raw body (the others)."""

    rpc: str
    payload: object
    cancel: bool = False


@st.composite
def public_calls(draw) -> PublicCall:
    rpc = draw(st.sampled_from(PUBLIC_RPCS))
    if rpc in ("Generate", "Submit"):
        payload = draw(st.one_of(generate_requests(), raw_bodies(CHEAP_REQUEST.SerializeToString())))
        return PublicCall(rpc, payload, cancel=rpc == "Generate" and chance(draw, 10))
    if rpc in ("WatchJob", "GetJob", "CancelJob"):
        return PublicCall(rpc, draw(st.one_of(job_ids, st.builds(OthersJob, st.integers(0, 1000)))))
    if rpc == "ListJobs":
        state, limit = draw(st.one_of(st.integers(0, 5), INT32)), draw(st.one_of(st.integers(0, 1000), INT32))
        return PublicCall(rpc, (state, limit))
    return PublicCall(rpc, draw(st.one_of(st.just(b""), mangled(b""))))


def _unauthenticated(fuzzer: Fuzzer, rpc: str, body: bytes, timeout: float, meta) -> None:
    """A call that presents no valid key ends with UNAUTHENTICATED: never an answer, nor any other refusal."""
    path = GENERATION[rpc.partition(" ")[0]]
    outcome = invoke(fuzzer.orchestrator, path, METHODS[path][1], [body], timeout=timeout, metadata=meta)
    allowed = {Code.UNAUTHENTICATED}
    if timeout < CALL_TIMEOUT_S:
        allowed.add(Code.DEADLINE_EXCEEDED)
    if len(body) >= LARGE_BODY_BYTES:
        allowed.add(Code.RESOURCE_EXHAUSTED)
    fuzzer.check(rpc, outcome, allowed, (body, meta))
    assert not outcome.responses, f"{rpc} answered a call without a valid key"


@settings(max_examples=300, **SETTINGS)
@given(call=public_calls(), credential=credentials(), timeout=timeouts, meta=metadata)
# Within either tenant's quotas: each tenant has a job the other may then look for; zeta's fourth request in a
# row finds its burst of 3 spent.
@example(call=PublicCall("Submit", CHEAP_REQUEST), credential=("key", "epsilon"), timeout=CALL_TIMEOUT_S, meta=())
@example(call=PublicCall("Submit", CHEAP_REQUEST), credential=("key", "zeta"), timeout=CALL_TIMEOUT_S, meta=())
@example(call=PublicCall("Generate", CHEAP_REQUEST), credential=("key", "zeta"), timeout=CALL_TIMEOUT_S, meta=())
@example(call=PublicCall("Submit", CHEAP_REQUEST), credential=("key", "zeta"), timeout=CALL_TIMEOUT_S, meta=())
@example(call=PublicCall("Generate", CHEAP_REQUEST), credential=("key", "zeta"), timeout=CALL_TIMEOUT_S, meta=())
# Within epsilon's 9 frames, but 65 after interpolation: beyond its 33 output frames.
@example(
    call=PublicCall(
        "Submit",
        generation_pb2.GenerateRequest(
            prompt="a fox",
            height=32,
            width=32,
            num_frames=9,
            num_inference_steps=1,
            interpolation=generation_pb2.InterpolationParams(enable=True, exp=3),
        ),
    ),
    credential=("key", "epsilon"),
    timeout=CALL_TIMEOUT_S,
    meta=(),
)
# Each tenant asks for the other's job.
@example(call=PublicCall("GetJob", OthersJob(0)), credential=("key", "epsilon"), timeout=CALL_TIMEOUT_S, meta=())
@example(call=PublicCall("WatchJob", OthersJob(0)), credential=("key", "epsilon"), timeout=CALL_TIMEOUT_S, meta=())
@example(call=PublicCall("CancelJob", OthersJob(0)), credential=("key", "zeta"), timeout=CALL_TIMEOUT_S, meta=())
# Larger than any server takes (64 MiB), without a key.
@example(
    call=PublicCall("Submit", generation_pb2.GenerateRequest(prompt="x" * (65 << 20))),
    credential=("no key", ""),
    timeout=CALL_TIMEOUT_S,
    meta=(),
)
def fuzz_public_with_keys(fuzzer: Fuzzer, call: PublicCall, credential, timeout, meta) -> None:
    """Every Generation method with a tenant's key, or with metadata that authenticates no one."""
    tenant, presented = fuzzer.credential(credential)
    meta = tuple(entry for entry in meta if entry[0] != "authorization") + presented
    label = f" [{tenant or credential[0]}]"
    rpc, payload = call.rpc, call.payload
    if rpc in ("WatchJob", "GetJob", "CancelJob"):
        job_id = payload
        if isinstance(payload, KnownJob):
            job_id = fuzzer.known_job(payload.pick)
        elif isinstance(payload, OthersJob):
            others = sorted(fuzzer.others_jobs(tenant or ""))
            job_id = others[payload.pick % len(others)] if others else ""
        if tenant is not None:
            _lookup(fuzzer, rpc, job_id, timeout, meta, tenant, label)
            return
        body = getattr(generation_pb2, f"{rpc}Request")(job_id=job_id).SerializeToString()
    elif rpc == "ListJobs":
        state, limit = payload
        if tenant is not None:
            _list_jobs(fuzzer, state, limit, meta, tenant, label)
            return
        body = generation_pb2.ListJobsRequest(state=state, limit=limit).SerializeToString()
    elif rpc in ("Generate", "Submit"):
        body = payload if isinstance(payload, bytes) else payload.SerializeToString()
        if tenant is not None and rpc == "Generate":
            _generate(fuzzer, rpc + label, body, payload, timeout, meta, call.cancel, tenant)
            return
        if tenant is not None:
            _submit(fuzzer, rpc + label, body, payload, timeout, meta, tenant)
            return
    else:
        body = payload
        if tenant is not None:
            _cluster_query(fuzzer, rpc, body, meta, tenant, label)
            return
    _unauthenticated(fuzzer, rpc + label, body, timeout, meta)


FUZZERS = (
    fuzz_generate,
    fuzz_submit,
    fuzz_job_lookups,
    fuzz_list_jobs,
    fuzz_cluster_queries,
    fuzz_encode,
    fuzz_denoise,
    fuzz_decode,
    fuzz_interpolate,
    fuzz_stage_info,
    fuzz_health,
    fuzz_without_the_secret,
    fuzz_raw_bytes,
    fuzz_unknown_methods,
)
# With tenants, the public RPCs with keys; health and unknown methods, which need no key. The stages do not
# know tenants: the `open` run fuzzes them.
TENANT_FUZZERS = (fuzz_public_with_keys, fuzz_health, fuzz_unknown_methods)

# ------------------------------------------------------------------------------------------------- the test --


def _wait_until_finished(fuzzer: Fuzzer, job_ids, timeout_s: float, tenant: str = "") -> dict[str, generation_pb2.Job]:
    stub = generation_pb2_grpc.GenerationStub(fuzzer.orchestrator)
    finished: dict[str, generation_pb2.Job] = {}
    waiting = set(job_ids)
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for job_id in sorted(waiting):
            job = stub.GetJob(generation_pb2.GetJobRequest(job_id=job_id), timeout=10, metadata=fuzzer.auth(tenant))
            if job.state in TERMINAL:
                finished[job_id] = job
                waiting.discard(job_id)
        time.sleep(0.2)
    assert not waiting, f"jobs accepted during the fuzzing never finished: {sorted(waiting)}"
    return finished


@dataclass
class FuzzTarget:
    mode: str  # "open" or "tenants"
    cluster: LocalCluster
    keys: dict[str, str]  # tenant -> API key; empty for the open tenant


@pytest.fixture(scope="module", params=["open", "tenants"])
def fuzz_target(
    request: pytest.FixtureRequest, tiny_model: Path, cluster_pool: ClusterPool, tenants_file: TenantsFile
) -> FuzzTarget:
    """The shared open cluster, or the pooled tenants cluster with the keys of TENANT_QUOTAS' tenants."""
    if request.param == "open":
        return FuzzTarget("open", request.getfixturevalue("cluster"), {})
    keys = {name: tenants_file.keys[name] for name in TENANT_QUOTAS}
    return FuzzTarget("tenants", tenants_cluster(cluster_pool, tiny_model, tenants_file), keys)


def test_fuzzing_every_rpc_leaves_the_cluster_whole(fuzz_target: FuzzTarget) -> None:
    cluster, with_tenants = fuzz_target.cluster, fuzz_target.mode == "tenants"
    started = time.time()
    options = [("grpc.max_receive_message_length", 64 << 20)]
    fuzzer = Fuzzer(
        orchestrator=grpc.insecure_channel(cluster.endpoint, options=options),
        stages={stage: stage_channel(cluster.services[stage].endpoint) for stage in STAGES},
        bare={stage: grpc.insecure_channel(cluster.services[stage].endpoint) for stage in STAGES},
        keys=fuzz_target.keys,
    )
    try:
        for fuzz in TENANT_FUZZERS if with_tenants else FUZZERS:
            fuzz(fuzzer)

        calls = sum(fuzzer.codes.values())
        by_code = Counter()
        for (_, code), count in fuzzer.codes.items():
            by_code[code] += count
        print(f"\n{calls} calls in {time.time() - started:.0f} s; status codes: {dict(by_code.most_common())}")
        for (rpc, code), count in sorted(fuzzer.codes.items()):
            print(f"  {rpc}: {code} x {count}")
        if with_tenants:
            print(
                f"lookups of another tenant's job: {fuzzer.cross_tenant_lookups}; "
                f"RESOURCE_EXHAUSTED with a RetryInfo: {dict(fuzzer.retry_advised)}"
            )
        least = MIN_CALLS_WITH_TENANTS if with_tenants else MIN_CALLS
        assert calls >= least, f"only {calls} calls were made; at least {least} were meant to be"
        assert fuzzer.accepted, "no request was accepted: the fuzzing never reached a running job"
        if with_tenants:
            # Both tenants ran jobs, calls without a valid key were made, and the small rate was spent.
            for tenant in TENANT_QUOTAS:
                assert tenant in fuzzer.owners.values(), f"no job was accepted for tenant '{tenant}'"
            assert by_code[Code.UNAUTHENTICATED.name] > 0, "no call without a valid key was made"
            assert fuzzer.retry_advised[RATE_LIMITED_TENANT] > 0, f"'{RATE_LIMITED_TENANT}' never met its rate limit"
            assert fuzzer.cross_tenant_lookups > 0, "no tenant asked for another tenant's job"
        else:
            # Some random requests went past every check, into the stages' compute and into running jobs.
            for rpc in ("TextEncoder.Encode", "Denoiser.Denoise", "VaeDecoder.Decode", "Interpolator.Interpolate"):
                assert fuzzer.codes[rpc, Code.OK.name] >= 2, f"no random {rpc} request was valid: {fuzzer.codes}"

        # Every service still serves, and every process is alive.
        for name, service in cluster.services.items():
            assert service.process.poll() is None, f"{name} exited with {service.process.returncode}"
        for name in ("orchestrator", *STAGES):
            channel = fuzzer.channel(name)
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, f"{name} no longer serves"

        # No job is lost: every job accepted during the fuzzing is listed (to its tenant, to no other) and ends,
        # with no server fault.
        stub = generation_pb2_grpc.GenerationStub(fuzzer.orchestrator)
        finished: dict[str, generation_pb2.Job] = {}
        for tenant in fuzz_target.keys or [""]:
            mine = [job_id for job_id, owner in fuzzer.owners.items() if owner == tenant]
            finished |= _wait_until_finished(fuzzer, mine, 2 * CALL_TIMEOUT_S, tenant)
            request = generation_pb2.ListJobsRequest(limit=1000)
            listed = {job.job_id: job for job in stub.ListJobs(request, timeout=10, metadata=fuzzer.auth(tenant)).jobs}
            missing = set(mine) - set(listed)
            assert not missing, f"accepted jobs missing from ListJobs: {sorted(missing)}"
            leaked = set(listed) & fuzzer.others_jobs(tenant)
            assert not leaked, f"tenant '{tenant}' lists other tenants' jobs: {sorted(leaked)}"
            # Jobs whose Submit ran into its deadline were never named to this test: they must end too.
            ours = [job.job_id for job in listed.values() if job.created_at.seconds >= int(started)]
            finished |= _wait_until_finished(fuzzer, ours, 2 * CALL_TIMEOUT_S, tenant)
            for job_id in ours:
                _check_output_frames(fuzzer, f"job {job_id}", _output_frames(listed[job_id].request), tenant)
        for job in finished.values():
            if job.state == generation_pb2.JOB_STATE_FAILED:
                code = CODES[job.error.code]
                assert code in JOB_ENDINGS, f"job {job.job_id} failed with {code.name}: {job.error.message}"
        states = Counter(generation_pb2.JobState.Name(job.state) for job in finished.values())
        print(f"jobs accepted during the fuzzing: {len(finished)}, {dict(states)}")

        # A normal generation still works.
        with Client(cluster.endpoint, api_key=fuzz_target.keys.get("epsilon")) as client:
            result = client.generate(
                "a lighthouse at dusk", height=32, width=32, num_frames=1, num_inference_steps=1, seed=3, timeout=60
            )
        assert result.frames.shape == (1, 32, 32, 3)
    finally:
        for channel in (fuzzer.orchestrator, *fuzzer.stages.values(), *fuzzer.bare.values()):
            channel.close()
