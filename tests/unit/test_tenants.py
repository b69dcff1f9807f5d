"""Tenants: the file format and its errors, API keys, the models a tenant may use, per-request size limits (per
model too) and the rate limiter."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import grpc
import pytest

from services.orchestrator.refusals import REFUSABLE, refusal_for
from services.orchestrator.tenants import (
    AuthenticationError,
    LimitExceeded,
    ModelNotAllowed,
    PriorityClass,
    Quotas,
    RateLimited,
    Tenant,
    TenantConfigError,
    TenantRegistry,
    hash_api_key,
    main,
    new_api_key,
    visible_models,
)
from stagediff.cli import main as stagediff_main
from stagediff.v1 import generation_pb2
from tests.helpers.tenants import EXAMPLE

KEY_ACME = "sd_acme-test-key-0123456789abcdefghijklmnopqrstuvwxyz"
KEY_ACME_2 = "sd_acme-second-key-0123456789abcdefghijklmnopqrstuvwx"
KEY_SOLO = "sd_solo-test-key-0123456789abcdefghijklmnopqrstuvwxyz"


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _data() -> dict:
    return {
        "tenants": [
            {
                "name": "acme",
                "api_keys": [hash_api_key(KEY_ACME), hash_api_key(KEY_ACME_2)],
                "priority": "high",
                "weight": 3,
                "quotas": {
                    "max_running_jobs": 2,
                    "max_queued_jobs": 10,
                    "requests_per_minute": 60,
                    "burst": 2,
                    "max_height": 512,
                    "max_width": 768,
                    "max_pixels": 512 * 512,
                    "max_frames": 33,
                    "max_steps": 20,
                },
            },
            {"name": "solo", "api_keys": [hash_api_key(KEY_SOLO)]},
        ]
    }


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _config_error(data: object) -> str:
    with pytest.raises(TenantConfigError) as caught:
        TenantRegistry.from_dict(data)
    return str(caught.value)


def test_the_example_file_loads_with_hashed_keys_only() -> None:
    registry = TenantRegistry.from_file(EXAMPLE)
    assert list(registry.tenants) == ["studio", "research", "free-tier", "ops"]
    assert [name for name, tenant in registry.tenants.items() if tenant.admin] == ["ops"]
    assert registry.tenants["free-tier"].quotas.max_output_frames == 129
    studio = registry.tenants["studio"]
    assert studio.priority == PriorityClass.HIGH and studio.weight == 2
    assert studio.quotas.max_frames == 121 and studio.quotas.bucket_capacity == 20
    assert registry.tenants["research"].quotas.bucket_capacity == 30  # default burst: a minute's worth
    assert registry.tenants["free-tier"].priority.rank > registry.tenants["research"].priority.rank
    assert not registry.is_open
    research = registry.tenants["research"]
    assert research.models == ("wan-t2v", "qwen-*") and research.may_use("qwen-image")
    assert not research.may_use("wan-i2v") and studio.may_use("wan-i2v")  # studio lists none: every model
    assert research.quotas_for("wan-t2v").max_running_jobs == 1 and research.quotas_for("qwen-image").max_frames == 1
    assert research.quotas_for("wan-t2v").max_frames == 81  # not set for the model: the tenant's own
    for tenant in registry.tenants.values():
        assert tenant.api_keys and all(re.fullmatch(r"sha256:[0-9a-f]{64}", key) for key in tenant.api_keys)


def test_defaults_of_a_tenant() -> None:
    solo = TenantRegistry.from_dict(_data()).tenants["solo"]
    assert solo.priority == PriorityClass.NORMAL and solo.weight == 1.0
    assert solo.quotas.max_running_jobs is None and solo.quotas.bucket_capacity is None
    assert [c.rank for c in (PriorityClass.HIGH, PriorityClass.NORMAL, PriorityClass.LOW)] == [0, 1, 2]


def test_a_plaintext_key_in_the_file_is_refused_without_being_repeated() -> None:
    data = _data()
    data["tenants"][0]["api_keys"] = ["sd_this-is-a-plaintext-key"]
    message = _config_error(data)
    assert "tenants[0] (acme).api_keys" in message and "not a key hash" in message
    assert "sd_this-is-a-plaintext-key" not in message


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d["tenants"][0]["quotas"].update(max_frames=-1), ["tenants[0] (acme).quotas.max_frames", "0"]),
        (lambda d: d["tenants"][0]["quotas"].update(max_frame=9), ["tenants[0] (acme).quotas.max_frame", "not"]),
        (lambda d: d["tenants"][1].update(priority="urgent"), ["tenants[1] (solo).priority", "high"]),
        (lambda d: d["tenants"][1].update(weight=0), ["tenants[1] (solo).weight", "greater than 0"]),
        (lambda d: d["tenants"][1].update(name="bad name!"), ["tenants[1]", ".name"]),
        (lambda d: d["tenants"][1].update(quotas={"burst": 3}), ["burst", "requests_per_minute"]),
        (lambda d: d["tenants"][1].update(name="acme"), ["tenant name 'acme' appears twice"]),
        (lambda d: d["tenants"][1].update(api_keys=[]), ["'solo'", "at least one key"]),
        (lambda d: d["tenants"][1].update(api_keys=[hash_api_key(KEY_ACME)]), ["'acme' and 'solo' share"]),
        (lambda d: d.update(tenants=[]), ["tenants", "at least 1"]),
        (lambda d: d["tenants"][1].update(models=["m"] * 257), ["tenants[1] (solo).models", "at most 256"]),
        (lambda d: d["tenants"][1].update(models=["m" * 130]), ["tenants[1] (solo).models[0]", "at most 129"]),
        (lambda d: d["tenants"][1].update(models=[""]), ["tenants[1] (solo).models[0]", "at least 1"]),
        (lambda d: d["tenants"][1].update(models="wan-*"), ["tenants[1] (solo).models", "tuple"]),
        (
            lambda d: d["tenants"][1].update(model_quotas={f"m{i}": {} for i in range(257)}),
            ["tenants[1] (solo).model_quotas", "at most 256"],
        ),
        (
            lambda d: d["tenants"][1].update(model_quotas={"m" * 129: {"max_height": 64}}),
            ["tenants[1] (solo).model_quotas.<a key of 129 characters>", "at most 128"],
        ),
        (
            lambda d: d["tenants"][1].update(model_quotas={"wan-t2v": {"max_height": 0}}),
            ["tenants[1] (solo).model_quotas.wan-t2v.max_height", "greater than 0"],
        ),
        (
            lambda d: d["tenants"][1].update(model_quotas={"wan-t2v": {"max_hieght": 64}}),
            ["tenants[1] (solo).model_quotas.wan-t2v.max_hieght", "not permitted"],
        ),
        (
            lambda d: d["tenants"][1].update(model_quotas={"wan-t2v": {"requests_per_minute": 6, "max_steps": 9}}),
            ["tenants[1] (solo).model_quotas", "'wan-t2v': requests_per_minute", "set them in quotas"],
        ),
    ],
)
def test_file_errors_name_the_field(change, words) -> None:
    data = _data()
    change(data)
    message = _config_error(data)
    for word in words:
        assert word in message, f"'{word}' not in: {message}"


def test_a_long_model_id_in_model_quotas_is_not_repeated() -> None:
    data = _data()
    data["tenants"][1]["model_quotas"] = {"x" * 5000: {"max_height": 64}}
    assert "x" * 200 not in _config_error(data)


def test_model_quotas_may_name_models_no_stage_serves_yet() -> None:
    data = _data()
    data["tenants"][1]["model_quotas"] = {"not-served-yet": {"max_height": 64}}
    data["tenants"][1]["models"] = ["not-served-*"]
    solo = TenantRegistry.from_dict(data).tenants["solo"]
    assert solo.quotas_for("not-served-yet").max_height == 64 and solo.may_use("not-served-yet")


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(TenantConfigError, match="cannot read the tenants file"):
        TenantRegistry.from_file(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("tenants: [\n  - name: x\n")
    with pytest.raises(TenantConfigError, match="broken.yaml: not valid YAML"):
        TenantRegistry.from_file(broken)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(TenantConfigError, match="empty.yaml"):
        TenantRegistry.from_file(empty)


def test_open_registry_needs_no_key() -> None:
    registry = TenantRegistry.open()
    assert registry.is_open
    assert registry.authenticate(()).name == "default"
    assert registry.authenticate(None).name == "default"
    assert registry.authenticate(_bearer("anything")).name == "default"


def test_every_key_of_a_tenant_authenticates_it() -> None:
    registry = TenantRegistry.from_dict(_data())
    assert registry.authenticate(_bearer(KEY_ACME)).name == "acme"
    assert registry.authenticate(_bearer(KEY_ACME_2)).name == "acme"
    assert registry.authenticate((("x-other", "1"), ("authorization", f"bearer  {KEY_SOLO} "))).name == "solo"


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ((), "missing API key"),
        ((("x-other", "1"),), "missing API key"),
        ((("authorization", f"Basic {KEY_ACME}"),), "malformed 'authorization' metadata"),
        ((("authorization", "Bearer "),), "malformed 'authorization' metadata"),
        ((("authorization", f"Bearer {KEY_ACME}"), ("authorization", f"Bearer {KEY_SOLO}")), "more than one"),
        ((("authorization", f"Bearer {KEY_ACME}x"),), "invalid API key"),
        ((("authorization", f"Bearer {hash_api_key(KEY_ACME)}"),), "invalid API key"),
    ],
)
def test_refused_keys_say_why_without_echoing_the_key(metadata, expected) -> None:
    registry = TenantRegistry.from_dict(_data())
    with pytest.raises(AuthenticationError) as caught:
        registry.authenticate(metadata)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert expected in caught.value.message
    assert "sd_" not in caught.value.message and "sha256:" not in caught.value.message


def test_new_keys_are_random_and_their_hash_authenticates() -> None:
    first, second = new_api_key(), new_api_key()
    assert first != second and first.startswith("sd_") and len(first) >= 40
    registry = TenantRegistry([Tenant(name="fresh", api_keys=(hash_api_key(first),))])
    assert registry.authenticate(_bearer(first)).name == "fresh"
    with pytest.raises(AuthenticationError, match="invalid API key"):
        registry.authenticate(_bearer(second))


def test_a_tenant_uses_the_models_its_ids_and_patterns_name() -> None:
    tenant = Tenant(name="acme", models=("wan-t2v", "qwen-*"))
    assert tenant.may_use("wan-t2v") and tenant.may_use("qwen-image") and tenant.may_use("qwen-image-edit")
    for model in ("wan-i2v", "wan-t2v-14b", "xwan-t2v", "QWEN-image", ""):
        assert not tenant.may_use(model), model
    # Without a `models` list, and for the open tenant: every model.
    for anyone in (Tenant(name="solo"), TenantRegistry.open().open_tenant):
        assert anyone.may_use("wan-i2v") and anyone.may_use("qwen-image")
    models = ["wan-i2v", "qwen-image", "wan-t2v", "qwen-image-edit"]
    assert visible_models(tenant, models) == ["qwen-image", "wan-t2v", "qwen-image-edit"]
    assert visible_models(Tenant(name="solo"), models) == models


def test_a_model_the_tenant_may_not_use_is_permission_denied_naming_only_its_own_models() -> None:
    acme = Tenant(name="acme", models=("wan-t2v", "qwen-*"))
    other = Tenant(name="beta", models=("secret-model-of-beta",))
    registry = TenantRegistry([acme, other])
    registry.check_model(acme, "wan-t2v")
    registry.check_model(acme, "qwen-image")
    with pytest.raises(ModelNotAllowed) as caught:
        registry.check_model(acme, "wan-i2v")
    error = caught.value
    assert error.code == grpc.StatusCode.PERMISSION_DENIED and (error.tenant, error.model) == ("acme", "wan-i2v")
    for word in ("tenant 'acme'", "model 'wan-i2v'", "wan-t2v, qwen-*"):
        assert word in error.message, f"'{word}' not in: {error.message}"
    assert "beta" not in error.message and "secret" not in error.message
    # The servicer answers it like the other refusals, dropping the request's uploads (a retry would fail again).
    assert isinstance(error, REFUSABLE)
    refusal = refusal_for(error)
    assert refusal.code == grpc.StatusCode.PERMISSION_DENIED and refusal.message == error.message
    assert refusal.drops_uploads and refusal.retry_after_s is None


def test_model_quotas_take_precedence_field_by_field() -> None:
    tenant = Tenant(
        name="acme",
        quotas=Quotas(max_height=512, max_width=768, max_frames=33, max_running_jobs=2, requests_per_minute=60),
        model_quotas={
            "wan-t2v": Quotas(max_height=256, max_frames=None, max_output_frames=65),
            "qwen-image": Quotas(max_running_jobs=1),
        },
    )
    t2v = tenant.quotas_for("wan-t2v")
    assert (t2v.max_height, t2v.max_frames, t2v.max_output_frames) == (256, None, 65)  # set, `null` lifts one
    assert (t2v.max_width, t2v.max_running_jobs, t2v.requests_per_minute) == (768, 2, 60)  # unset: the tenant's
    image = tenant.quotas_for("qwen-image")
    assert image.max_running_jobs == 1 and image.max_height == 512 and image.max_output_frames == 1025
    assert tenant.quotas_for("wan-i2v") == tenant.quotas and tenant.quotas_for("") == tenant.quotas
    assert hash(tenant) == hash(tenant.model_copy())  # a tenant with model quotas can still be hashed


def _request(**fields) -> generation_pb2.GenerateRequest:
    full = {"prompt": "p", "height": 512, "width": 512, "num_frames": 33, "num_inference_steps": 20}
    full.update(fields)
    return generation_pb2.GenerateRequest(**full)


def test_requests_at_the_limits_pass() -> None:
    registry = TenantRegistry.from_dict(_data())
    registry.check_request_limits(registry.tenants["acme"], _request())
    registry.check_request_limits(registry.tenants["acme"], _request(height=256, width=768))
    huge = _request(height=4096, width=4096, num_frames=1001, num_inference_steps=1000)
    lifted = {"max_output_frames": None, "max_output_pixels": None}
    unlimited = TenantRegistry.from_dict(
        {"tenants": [{"name": "free", "api_keys": [hash_api_key(KEY_SOLO)], "quotas": lifted}]}
    )
    unlimited.check_request_limits(unlimited.tenants["free"], huge)  # every limit lifted
    # With no quotas in the file (solo), and for the open tenant, what a job produces is still bounded.
    for tenant in (registry.tenants["solo"], TenantRegistry.open().open_tenant):
        with pytest.raises(LimitExceeded) as raised:
            registry.check_request_limits(tenant, huge)
        assert raised.value.field == "output pixels" and raised.value.limit == 2**29  # 1001 frames of 16 Mpx


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"height": 528, "width": 256}, "height", ["height: 528", "limit of 512"]),
        ({"height": 256, "width": 784}, "width", ["width: 784", "limit of 768"]),
        ({"height": 512, "width": 528}, "height*width", ["height*width: 512x528 = 270336 pixels", "limit of 262144"]),
        ({"num_frames": 37}, "num_frames", ["num_frames: 37", "limit of 33"]),
        ({"num_inference_steps": 21}, "num_inference_steps", ["num_inference_steps: 21", "limit of 20"]),
    ],
)
def test_requests_beyond_a_limit_name_the_field_and_the_limit(fields, field, words) -> None:
    registry = TenantRegistry.from_dict(_data())
    with pytest.raises(LimitExceeded) as caught:
        registry.check_request_limits(registry.tenants["acme"], _request(**fields))
    error = caught.value
    assert error.code == grpc.StatusCode.PERMISSION_DENIED
    assert error.field == field and error.tenant == "acme"
    for word in [*words, "tenant 'acme'"]:
        assert word in error.message, f"'{word}' not in: {error.message}"


def test_request_limits_are_those_of_the_requests_model() -> None:
    data = _data()  # acme: max_height 512, max_width 768, max_frames 33
    data["tenants"][0]["model_quotas"] = {"wan-t2v": {"max_height": 256}, "qwen-image": {"max_height": 1024}}
    registry = TenantRegistry.from_dict(data)
    acme = registry.tenants["acme"]
    with pytest.raises(LimitExceeded) as caught:
        registry.check_request_limits(acme, _request(model="wan-t2v", height=512, width=256))
    error = caught.value
    assert error.message == "height: 512 exceeds tenant 'acme' limit of 256 for model 'wan-t2v'"
    assert (error.field, error.limit, error.model) == ("height", 256, "wan-t2v")
    registry.check_request_limits(acme, _request(model="qwen-image", height=1024, width=256))  # above the tenant's
    # A limit the model's quotas leave unset is the tenant's own, and says so.
    with pytest.raises(LimitExceeded) as caught:
        registry.check_request_limits(acme, _request(model="wan-t2v", height=256, width=784))
    assert caught.value.message == "width: 784 exceeds tenant 'acme' limit of 768" and caught.value.model == ""
    # Other models, and a request without one, get the tenant's quotas.
    for model in ("wan-i2v", ""):
        with pytest.raises(LimitExceeded, match="limit of 512$"):
            registry.check_request_limits(acme, _request(model=model, height=1024, width=256))


def test_token_bucket_refills_at_the_rate_and_holds_at_most_burst() -> None:
    clock = FakeClock()
    registry = TenantRegistry.from_dict(_data(), clock=clock)
    acme = registry.tenants["acme"]  # 60 per minute, burst 2
    limiter = registry.rate_limiter
    assert limiter.acquire(acme) == 0.0
    assert limiter.acquire(acme) == 0.0
    assert limiter.acquire(acme) == pytest.approx(1.0)
    clock.now += 0.25
    assert limiter.acquire(acme) == pytest.approx(0.75)  # a refused request takes nothing
    clock.now += 0.75
    assert limiter.acquire(acme) == 0.0
    assert limiter.acquire(acme) == pytest.approx(1.0)
    clock.now += 3600  # a long quiet spell fills the bucket to burst, no further
    assert [limiter.acquire(acme) for _ in range(3)] == [0.0, 0.0, pytest.approx(1.0)]


def test_default_burst_is_a_minute_of_requests_and_tenants_have_their_own_buckets() -> None:
    clock = FakeClock()
    data = _data()
    data["tenants"][1]["quotas"] = {"requests_per_minute": 30}
    registry = TenantRegistry.from_dict(data, clock=clock)
    solo, acme = registry.tenants["solo"], registry.tenants["acme"]
    assert [registry.rate_limiter.acquire(solo) for _ in range(30)] == [0.0] * 30
    assert registry.rate_limiter.acquire(solo) == pytest.approx(2.0)
    assert registry.rate_limiter.acquire(acme) == 0.0  # acme's bucket is untouched


def test_unlimited_tenants_are_never_rate_limited() -> None:
    registry = TenantRegistry.open(clock=FakeClock())
    assert all(registry.rate_limiter.acquire(registry.open_tenant) == 0.0 for _ in range(10_000))


def test_check_rate_raises_with_the_wait() -> None:
    clock = FakeClock()
    registry = TenantRegistry.from_dict(_data(), clock=clock)
    acme = registry.tenants["acme"]
    registry.check_rate(acme)
    registry.check_rate(acme)
    with pytest.raises(RateLimited) as caught:
        registry.check_rate(acme)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.retry_after == pytest.approx(1.0) and caught.value.tenant == "acme"
    assert "tenant 'acme'" in caught.value.message and "60 requests per minute" in caught.value.message
    clock.now += 1.0
    registry.check_rate(acme)


def test_new_key_prints_a_key_and_the_hash_that_authenticates_it(capsys) -> None:
    assert main(["new-key"]) == 0
    out = capsys.readouterr().out
    key = re.search(r"^key:\s+(\S+)$", out, re.MULTILINE).group(1)
    digest = re.search(r"^hash:\s+(sha256:[0-9a-f]{64})$", out, re.MULTILINE).group(1)
    assert digest == hash_api_key(key)
    registry = TenantRegistry.from_dict({"tenants": [{"name": "new", "api_keys": [digest]}]})
    assert registry.authenticate(_bearer(key)).name == "new"


def test_hash_key_reads_standard_input(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(KEY_SOLO + "\n"))
    assert main(["hash-key"]) == 0
    assert capsys.readouterr().out.strip() == hash_api_key(KEY_SOLO)


def test_stagediff_tenants_lists_a_files_tenants(capsys) -> None:
    assert stagediff_main(["tenants", "list", str(EXAMPLE)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "PRIORITY", "ADMIN", "KEYS", "MODELS", "QUOTAS"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == ["studio", "research", "free-tier", "ops"]
    assert rows["studio"].split()[1:5] == ["high", "no", "2", "all"] and "max_running_jobs=4" in rows["studio"]
    assert rows["research"].split()[4] == "wan-t2v,qwen-*" and "[qwen-image: max_frames=1]" in rows["research"]
    assert rows["ops"].split() == ["ops", "low", "yes", "1", "all", "max_running_jobs=1"]


def test_stagediff_tenants_check_prints_each_problem_with_its_path(capsys, tmp_path: Path) -> None:
    assert stagediff_main(["tenants", "check", str(EXAMPLE)]) == 0
    assert "4 tenant(s): studio, research, free-tier, ops" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - name: x\n    api_keys: [sd_plain]\n    quotas: {max_frames: -1}\n")
    assert stagediff_main(["tenants", "check", str(bad)]) == 1
    problems = capsys.readouterr().err.splitlines()
    assert len(problems) == 2 and "sd_plain" not in problems[0]
    assert problems[0].startswith(f"{bad}: tenants[0] (x).api_keys: entry 0 is not a key hash")
    assert "(stagediff tenants new-key prints one)" in problems[0]
    assert problems[1] == f"{bad}: tenants[0] (x).quotas.max_frames: Input should be greater than 0"
