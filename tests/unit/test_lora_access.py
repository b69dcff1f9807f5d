"""Which adapters a tenant may use (services/orchestrator/lora_access.py), and the checks of a request's
adapters every service runs (services/validation.py resolve_loras). No torch."""

from __future__ import annotations

import grpc
import pytest

from services.orchestrator.lora_access import LoraNotAllowed, LoraNotFound, check_loras, visible
from services.orchestrator.tenants import MAX_LORA_PATTERNS, Tenant, TenantConfigError, TenantRegistry
from services.validation import resolve_loras
from stagediff.v1 import stages_pb2
from stagekit.errors import RequestError

LISTED = ["style-ink", "style-oil", "anime", "acme/logo", "globex/logo"]
LIMITS = stages_pb2.ModelLimits(loras=[stages_pb2.LoraInfo(name=name, bytes=10) for name in LISTED], max_loras=4)
ACME = Tenant(name="acme", api_keys=("sha256:" + "0" * 64,), loras=("style-*",))
GLOBEX = Tenant(name="globex", api_keys=("sha256:" + "1" * 64,))


def _loras(*names: str) -> list[stages_pb2.LoraAdapter]:
    return [stages_pb2.LoraAdapter(name=name, scale=1.0) for name in names]


def test_a_tenant_sees_and_uses_its_patterns_and_its_own_adapters_only() -> None:
    assert [info.name for info in visible(ACME, LIMITS.loras)] == ["style-ink", "style-oil", "acme/logo"]
    assert [info.name for info in visible(GLOBEX, LIMITS.loras)] == ["globex/logo"], "default: none but its own"
    check_loras(ACME, _loras("style-ink", "acme/logo"), LIMITS)
    check_loras(GLOBEX, _loras("globex/logo"), LIMITS)
    open_tenant = TenantRegistry.open().open_tenant
    assert [info.name for info in visible(open_tenant, LIMITS.loras)] == ["style-ink", "style-oil", "anime"]


@pytest.mark.parametrize(
    ("tenant", "name", "error", "code"),
    [
        (ACME, "anime", LoraNotAllowed, grpc.StatusCode.PERMISSION_DENIED),
        (GLOBEX, "style-ink", LoraNotAllowed, grpc.StatusCode.PERMISSION_DENIED),
        (ACME, "missing", LoraNotFound, grpc.StatusCode.NOT_FOUND),
        # Another tenant's private adapter is answered as absent, even to a tenant whose patterns match it.
        (ACME, "globex/logo", LoraNotFound, grpc.StatusCode.NOT_FOUND),
        (Tenant(name="wild", api_keys=("sha256:" + "2" * 64,), loras=("*",)), "acme/logo", LoraNotFound, None),
    ],
)
def test_an_adapter_a_tenant_cannot_use_is_refused_naming_it(tenant, name, error, code) -> None:
    with pytest.raises(error) as raised:
        check_loras(tenant, _loras("style-ink", name) if tenant is ACME else _loras(name), LIMITS)
    assert f"'{name}'" in raised.value.message and "loras[" in raised.value.message
    if code is not None:
        assert raised.value.code == code


def test_a_model_without_adapters_per_request_finds_none() -> None:
    with pytest.raises(LoraNotFound, match="serves none per request"):
        check_loras(ACME, _loras("style-ink"), stages_pb2.ModelLimits())


def test_resolve_loras_fills_scales_and_refuses_what_is_malformed() -> None:
    resolved = resolve_loras(LIMITS, [stages_pb2.LoraAdapter(name="a"), stages_pb2.LoraAdapter(name="b", scale=0.0)])
    assert [(lora.name, lora.scale) for lora in resolved] == [("a", 1.0), ("b", 0.0)]
    for loras, words in (
        ([stages_pb2.LoraAdapter(name="../etc/passwd")], "loras[0].name"),
        ([stages_pb2.LoraAdapter(name="a/b/c")], "not an adapter name"),
        ([stages_pb2.LoraAdapter(name="x" * 65)], "up to 64"),
        ([stages_pb2.LoraAdapter(name="a"), stages_pb2.LoraAdapter(name="a")], "named twice"),
        ([stages_pb2.LoraAdapter(name="a", scale=float("nan"))], "loras[0].scale"),
        ([stages_pb2.LoraAdapter(name="a", scale=11.0)], "-10 to 10"),
        (_loras("a", "b", "c", "d", "e"), "at most 4"),
    ):
        with pytest.raises(RequestError, match=words.replace("[", r"\[").replace(".", r"\.")):
            resolve_loras(LIMITS, loras)


def test_the_tenants_file_bounds_its_lora_patterns(tmp_path) -> None:
    key = "sha256:" + "3" * 64
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  - name: acme\n    api_keys: ['{key}']\n    loras: ['style-*', anime]\n")
    assert TenantRegistry.from_file(path).tenants["acme"].loras == ("style-*", "anime")
    too_many = ", ".join(f"p{i}" for i in range(MAX_LORA_PATTERNS + 1))
    for loras in (f"[{too_many}]", "['']", "[" + "x" * 200 + "]"):
        path.write_text(f"tenants:\n  - name: acme\n    api_keys: ['{key}']\n    loras: {loras}\n")
        with pytest.raises(TenantConfigError, match="loras"):
            TenantRegistry.from_file(path)


def test_the_sdk_and_cli_name_adapters_with_scales() -> None:
    from stagediff.client import build_request
    from stagediff.client_cli import _lora_argument

    for loras in ({"a": 0.5, "acme/b": 1.0}, [("a", 0.5), ("acme/b", 1.0)]):
        request = build_request("p", loras=loras)
        assert [(lora.name, lora.scale) for lora in request.loras] == [("a", 0.5), ("acme/b", 1.0)]
    request = build_request("p", loras=["a"])
    assert request.loras[0].name == "a" and not request.loras[0].HasField("scale"), "unset: the server's 1"
    assert _lora_argument("acme/b:0.25") == ("acme/b", 0.25) and _lora_argument("a") == ("a", 1.0)
    with pytest.raises(Exception, match="NAME:SCALE"):
        _lora_argument("a:x")
