"""The orchestrator's step-scheduling flags become its config's policies, checked once, naming the flag; a tenant's
`preemptible` reaches scheduling."""

from __future__ import annotations

import pytest

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.options import build_parser
from services.orchestrator.preemption import CheckpointPolicy, PreemptionPolicy
from services.orchestrator.tenants import PriorityClass, TenantConfigError, TenantRegistry, TenantScheduling
from tests.helpers.serving import parse_serve

STAGES = ["--dit", "d:1", "--text-encoder", "t:1", "--vae", "v:1"]
KEY = "sha256:" + "ab" * 32


def config(*flags: str) -> OrchestratorConfig:
    return OrchestratorConfig.from_options(parse_serve(["orchestrator", *STAGES, *flags]))


def test_defaults_preempt_and_do_not_checkpoint() -> None:
    chosen = config()
    assert chosen.preemption == PreemptionPolicy(enabled=True, max_preemptions=2, protect_last_steps=3)
    assert chosen.checkpoint == CheckpointPolicy(every=0, min_steps=20)


def test_flags_set_the_policies() -> None:
    chosen = config(
        "--preemption", "off", "--max-preemptions", "0", "--preemption-protect-steps", "7",
        "--checkpoint-every", "5", "--checkpoint-min-steps", "12",
    )  # fmt: skip
    assert chosen.preemption == PreemptionPolicy(enabled=False, max_preemptions=0, protect_last_steps=7)
    assert chosen.checkpoint == CheckpointPolicy(every=5, min_steps=12)
    assert chosen.checkpoint.every_for(11) == 0 and chosen.checkpoint.every_for(12) == 5


def test_the_environment_sets_them_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEDIFF_PREEMPTION", "off")
    monkeypatch.setenv("STAGEDIFF_CHECKPOINT_EVERY", "10")
    chosen = config()
    assert chosen.preemption.enabled is False
    assert chosen.checkpoint.every == 10


@pytest.mark.parametrize(
    "flag", ["--max-preemptions", "--preemption-protect-steps", "--checkpoint-every", "--checkpoint-min-steps"]
)
def test_a_negative_count_is_refused_naming_its_flag(flag: str) -> None:
    with pytest.raises(ValueError, match=f"^{flag} -1: use 0 or more$"):
        config(flag, "-1")


def test_preemption_takes_on_or_off_only() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*STAGES, "--preemption", "maybe"])


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    for flag in (
        "--preemption {on,off}", "--max-preemptions N", "--preemption-protect-steps N",
        "--checkpoint-every K", "--checkpoint-min-steps M",
    ):  # fmt: skip
        assert flag in shown


def test_a_tenants_preemptible_reaches_scheduling() -> None:
    registry = TenantRegistry.from_dict(
        {
            "tenants": [
                {"name": "kept", "api_keys": [KEY], "priority": "low", "weight": 2, "preemptible": False},
                {"name": "plain", "api_keys": ["sha256:" + "cd" * 32]},
            ]
        }
    )
    assert registry.tenants["kept"].preemptible is False
    assert registry.scheduling("kept") == TenantScheduling(PriorityClass.LOW, 2.0, False)
    assert registry.scheduling("plain") == TenantScheduling(PriorityClass.NORMAL, 1.0, True)
    assert registry.scheduling("gone") == TenantScheduling()  # a recovered job's tenant no longer in the file
    assert TenantRegistry.open().scheduling("default").preemptible is True


def test_preemptible_must_be_a_boolean() -> None:
    with pytest.raises(TenantConfigError, match=r"tenants\[0\] \(x\)\.preemptible"):
        TenantRegistry.from_dict({"tenants": [{"name": "x", "api_keys": [KEY], "preemptible": "sometimes"}]})
