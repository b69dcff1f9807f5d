"""The input images of a request, by role: which roles a model takes, and the images in the order it takes them.

A request's images travel as `InputImage` messages (encoded bytes and a role) from the client through the
orchestrator to the stages that see them: the VAE's Encode always, the text encoder where the family
embeds images itself. Each of those checks the images against the served checkpoint's roles, decodes them
with Pillow (services/images.py: formats, pixel limits before decoding, the RGB conversion diffusers
applies) and hands them to the family's compute in its role order, so that the orchestrator and every
stage agree on what each image is. No torch here: the orchestrator uses it too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.images import MAX_IMAGE_PIXELS, Stop, decode_image
from stagediff.v1 import image_pb2
from stagekit.errors import RequestError
from stagekit.images import DecodedImage

if TYPE_CHECKING:
    from services.checkpoint import CheckpointSpec

# ImageRole values and the names ModelLimits and the families use for them.
ROLE_NAMES = {
    image_pb2.IMAGE_ROLE_FIRST_FRAME: "first_frame",
    image_pb2.IMAGE_ROLE_LAST_FRAME: "last_frame",
    image_pb2.IMAGE_ROLE_REFERENCE: "reference",
}
ROLE_VALUES = {name: value for value, name in ROLE_NAMES.items()}


def image_roles(
    images: Sequence[image_pb2.InputImage], roles: Sequence[str], required: Sequence[str], model: str
) -> list[str]:
    """The role of each image (an unspecified role is the model's first), checked against what the model takes.

    A role may be sent as many times as `roles` lists it (once, but for the several reference images of
    Qwen-Image-Edit-Plus). Refuses (RequestError naming the field) an image for a model that takes none, a
    role it does not take, a role sent more often than that and a required role left out.
    """
    if images and not roles:
        raise RequestError(f"images: model '{model}' takes no input images (text only); leave images empty")
    names: list[str] = []
    for index, image in enumerate(images):
        if image.role == image_pb2.IMAGE_ROLE_UNSPECIFIED:
            name = roles[0]
        elif image.role in ROLE_NAMES:
            name = ROLE_NAMES[image.role]
        else:
            raise RequestError(f"images[{index}].role: {image.role} is not an ImageRole; allowed: {', '.join(roles)}")
        if name not in roles:
            raise RequestError(
                f"images[{index}].role: model '{model}' takes no {name} image; it takes {', '.join(roles)}"
            )
        allowed = roles.count(name)
        if names.count(name) >= allowed:
            if allowed == 1:
                raise RequestError(f"images[{index}].role: a second {name} image; send each role at most once")
            raise RequestError(
                f"images[{index}].role: {names.count(name) + 1} {name} images; model '{model}' takes at most {allowed}"
            )
        names.append(name)
    missing = [role for role in required if role not in names]
    if missing:
        raise RequestError(
            f"images: model '{model}' requires a {' and a '.join(missing)} image; add it to images "
            f"(roles taken: {', '.join(roles)})"
        )
    return names


def decode_images(
    images: Sequence[image_pb2.InputImage],
    roles: Sequence[str],
    required: Sequence[str],
    model: str,
    max_pixels: int = MAX_IMAGE_PIXELS,
    stop: Stop | None = None,
) -> list[DecodedImage]:
    """The request's images decoded to RGB, in the model's role order (its first role first; the images of
    one role in the order they were sent)."""
    names = image_roles(images, roles, required, model)
    decoded = [
        DecodedImage(name, decode_image(image.data, f"images[{index}].data", max_pixels, stop), _sha256(image.data))
        for index, (image, name) in enumerate(zip(images, names, strict=True))
    ]
    return sorted(decoded, key=lambda item: roles.index(item.role))


def decode_stage_images(
    images: Sequence[image_pb2.InputImage], spec: CheckpointSpec, stop: Stop | None = None
) -> list[DecodedImage]:
    """A stage's check of a request's images against its checkpoint (count, bytes in all, roles, pixels),
    then `decode_images`: what the text encoder and the VAE's Encode both run on what they are sent, on their
    image workers (services/image_work.py), never on the compute thread."""
    if len(images) > len(spec.image_roles):
        raise RequestError(f"images: {len(images)} sent; at most {len(spec.image_roles)} are allowed")
    total = sum(len(image.data) for image in images)
    if total > spec.max_image_bytes:
        raise RequestError(f"images: {total} bytes in all; at most {spec.max_image_bytes} are allowed")
    return decode_images(
        images, spec.image_roles, spec.required_image_roles, spec.model_id, spec.max_image_pixels, stop
    )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
