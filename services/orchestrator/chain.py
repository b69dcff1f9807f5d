"""Which stages serve a request: the served family's chain, and the stages this deployment has.

The DiT says which family it serves (`StageInfo.family`); the family declares its chain of stages
(families/): Wan runs text-encoder -> dit -> vae -> [interp], Qwen-Image text-encoder -> dit -> vae. The
orchestrator has endpoints for the stages it was given (`--<stage>`), which need not be every stage kind:

- a stage of the chain that is not optional, without an endpoint: the cluster cannot serve at all. The
  orchestrator says so (`chain_problem`): its health stays NOT_SERVING, and it refuses every request with
  FAILED_PRECONDITION naming the flag that would fix it;
- an optional stage (interp) without an endpoint: requests that leave it off are served, and requests that
  ask for it are refused with FAILED_PRECONDITION naming the request field;
- a request asking for a stage its family's chain does not have (interpolation of single images) is refused
  with INVALID_ARGUMENT.

Nothing here imports torch: the orchestrator relays bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from families.base import Family
from families.registry import family_named
from stagediff.v1 import generation_pb2, stages_pb2
from stagekit.errors import RequestError


@dataclass(frozen=True)
class OptionalStage:
    """How a request asks for an optional stage: the request field, and whether the request asks."""

    field: str
    what: str  # the stage, as a user calls it
    asked: Callable[[generation_pb2.GenerateRequest], bool]


OPTIONAL_STAGES: dict[str, OptionalStage] = {
    "interp": OptionalStage(
        field="interpolation",
        what="frame interpolator",
        asked=lambda request: request.interpolation.enable and request.interpolation.exp > 0,
    ),
}


class StageNotDeployed(Exception):
    """The request needs a stage this orchestrator has no endpoint for (FAILED_PRECONDITION)."""


def served_family(info: stages_pb2.StageInfo | None) -> Family | None:
    """The family the DiT serves, from its StageInfo (None until a DiT replica has answered).

    Raises StageNotDeployed when this orchestrator does not know the family (a DiT of another version).
    """
    if info is None:
        return None
    try:
        return family_named(info.family)
    except ValueError as error:
        raise StageNotDeployed(f"the DiT serves model '{info.model}': {error}") from None


def missing_stages(deployed: Collection[str], dit_info: stages_pb2.StageInfo | None) -> list[str]:
    """The stages the served chain cannot do without that have no endpoint here, in chain order.

    ["dit"] without a DiT (it says which chain the cluster serves); [] while the DiT has not answered yet,
    or serves a family this orchestrator does not know (`chain_problem` says so).
    """
    if "dit" not in deployed:
        return ["dit"]
    try:
        family = served_family(dit_info)
    except StageNotDeployed:
        return []
    if family is None:
        return []
    return [stage for stage in family.required_stages() if stage not in deployed]


def chain_problem(deployed: Collection[str], dit_infos: Sequence[stages_pb2.StageInfo]) -> str | None:
    """Why this deployment cannot serve one of the DiTs' models (a stage of its chain has no endpoint), or None."""
    answered: Sequence[stages_pb2.StageInfo | None] = dit_infos or [None]  # none: no DiT has answered yet
    for info in answered:
        problem = model_problem(deployed, info)
        if problem is not None:
            return problem
    return None


def model_problem(deployed: Collection[str], dit_info: stages_pb2.StageInfo | None) -> str | None:
    """Why this deployment cannot serve the DiT's model (a stage of its chain has no endpoint), or None.

    None also while the DiT has not answered yet: its family, and so its chain, is not known.
    """
    if "dit" not in deployed:
        return (
            "this orchestrator has no endpoint for dit: start it with --dit HOST:PORT (the DiT says which "
            "model, and so which chain of stages, the cluster serves)"
        )
    try:
        family = served_family(dit_info)
    except StageNotDeployed as error:
        return str(error)
    missing = missing_stages(deployed, dit_info)
    if family is None or not missing:
        return None
    flags = ", ".join(f"--{stage} HOST:PORT" for stage in missing)
    return (
        f"the served model's family {family.name} runs {describe_chain(family)}, and this orchestrator has no "
        f"endpoint for {', '.join(missing)}: start it with {flags}"
    )


def describe_chain(family: Family) -> str:
    """The chain as docs/features.md shows it: "text-encoder -> dit -> vae -> [interp]"."""
    return " -> ".join(f"[{stage}]" if stage in family.optional_stages else stage for stage in family.chain)


def stages_for(family: Family, request: generation_pb2.GenerateRequest) -> tuple[str, ...]:
    """The stages a request runs through, in order: the family's chain less the optional stages it leaves off."""
    return tuple(
        stage
        for stage in family.chain
        if stage not in family.optional_stages or (stage in OPTIONAL_STAGES and OPTIONAL_STAGES[stage].asked(request))
    )


def check_request(family: Family, deployed: Collection[str], request: generation_pb2.GenerateRequest) -> None:
    """Refuses a request that asks for an optional stage its family lacks (RequestError) or that this
    deployment lacks (StageNotDeployed), naming the request field."""
    for stage, optional in OPTIONAL_STAGES.items():
        if not optional.asked(request):
            continue
        if stage not in family.chain:
            single = "; it makes single images, so there is nothing to interpolate" if family.output == "image" else ""
            raise RequestError(
                f"{optional.field}: model '{request.model}' ({family.name}) runs {describe_chain(family)}, "
                f"with no {optional.what}{single}; leave {optional.field} off"
            )
        if stage not in deployed:
            raise StageNotDeployed(
                f"{optional.field}: this deployment has no {optional.what} (the orchestrator runs without "
                f"--{stage}); leave {optional.field} off"
            )
