"""The image roles and sizes of a DiT request (DenoiseParams.image_roles, image_sizes), checked against the model."""

from __future__ import annotations

from services.checkpoint import CheckpointSpec
from stagediff.v1 import stages_pb2
from stagekit.errors import RequestError


def request_images(spec: CheckpointSpec, params: stages_pb2.DenoiseParams) -> dict[str, tuple]:
    """The request's image roles and sizes, checked against the model and put in its role order."""
    roles = list(params.image_roles)
    # A role may come as many times as the model lists it (services/input_images.py).
    repeated = any(roles.count(role) > spec.image_roles.count(role) for role in roles)
    if len(roles) > len(spec.image_roles) or repeated:
        raise RequestError(
            f"image_roles: {len(roles)} roles; send each of {', '.join(spec.image_roles) or 'none'} at most "
            "as many times as the model lists it"
        )
    for role in roles:
        if role not in spec.image_roles:
            raise RequestError(f"image_roles: '{role[:32]}' is not taken; allowed: {', '.join(spec.image_roles)}")
    missing = [role for role in spec.required_image_roles if role not in roles]
    if missing:
        raise RequestError(f"image_roles: {', '.join(missing)} required by model '{spec.model_id}'")
    sizes = [(size.width, size.height) for size in params.image_sizes]
    if sizes and len(sizes) != len(roles):
        raise RequestError(f"image_sizes: {len(sizes)} sizes for {len(roles)} image_roles; send one per image")
    for index, (width, height) in enumerate(sizes):
        if width < 1 or height < 1 or width * height > spec.max_image_pixels:
            raise RequestError(
                f"image_sizes[{index}]: {width}x{height} is not allowed; at most {spec.max_image_pixels} pixels"
            )
    # Stable: the images of one role keep the order they were sent in, as the other stages order them.
    order = sorted(range(len(roles)), key=lambda i: spec.image_roles.index(roles[i]))
    return {
        "image_roles": tuple(roles[i] for i in order),
        "image_sizes": tuple(sizes[i] for i in order) if sizes else (),
    }
