"""A request's input images, checked at the door against the served model's limits.

`check_image_budget` runs first, before a byte of any image is parsed: the count and the bytes of all
images. `probe_images` then reads each image's header (format, structure, and its pixel count before
anything is decoded: a decompression bomb never gets past it) on the orchestrator's image workers
(services/image_work.py), and `complete_images` runs with the rest of the request's validation
(services/orchestrator/request_defaults.py): each image's role against the roles the model takes and
requires. It fills in what the job records of each image: its role (an unspecified role becomes the
model's first), its SHA-256 and its size as decoded, the EXIF orientation applied (what the stages and the
family's pipeline see). `size_from_images` is the output size a family takes from an input image when the
request leaves height and width unset (Qwen-Image-Edit). `verify_images` then decodes each whole, on the
image workers too, so that a truncated or corrupt file is refused with INVALID_ARGUMENT before the job is
queued rather than failing it in a stage. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

from families.base import ImageInputs
from services.images import ImageInfo, Stop, decode_image, probe_image
from services.input_images import ROLE_NAMES, ROLE_VALUES, image_roles
from stagediff.v1 import generation_pb2, image_pb2, stages_pb2
from stagekit.errors import RequestError


def check_image_budget(images: Sequence[image_pb2.InputImage], limits: stages_pb2.ModelLimits) -> None:
    """Refuses more images, or more bytes of them in all, than the model takes; nothing is parsed."""
    if len(images) > limits.max_images:
        allowed = f"at most {limits.max_images}" if limits.max_images else "none (the model takes text only)"
        raise RequestError(f"images: {len(images)} sent; {allowed} are allowed")
    total = sum(len(image.data) for image in images)
    if total > limits.max_image_bytes:
        raise RequestError(
            f"images: {total} bytes of encoded images in all; at most {limits.max_image_bytes} are allowed"
        )


def probe_images(images: Sequence[image_pb2.InputImage], max_pixels: int, stop: Stop | None = None) -> list[ImageInfo]:
    """Each image's header, read without decoding (RequestError for the first refused); blocking."""
    return [probe_image(image.data, f"images[{index}].data", max_pixels, stop) for index, image in enumerate(images)]


def complete_images(
    request: generation_pb2.GenerateRequest,
    limits: stages_pb2.ModelLimits,
    probed: Sequence[ImageInfo] | None = None,
) -> None:
    """Checks `request.images` against the model's limits and records each image's role, digest and size.

    `probed` holds what `probe_images` read of each image, on the image workers; without it the headers
    are read here, on the calling thread.
    """
    images = request.images
    check_image_budget(images, limits)
    roles = image_roles(images, list(limits.image_roles), list(limits.required_image_roles), request.model)
    if probed is None:
        probed = probe_images(images, limits.max_image_pixels)
    for image, role, info in zip(images, roles, probed, strict=True):
        image.role = ROLE_VALUES[role]
        image.sha256 = info.sha256
        image.width, image.height = info.decoded_size


def size_from_images(
    request: generation_pb2.GenerateRequest, limits: stages_pb2.ModelLimits, images: ImageInputs
) -> tuple[int, image_pb2.InputImage, tuple[int, int]] | None:
    """The image a family takes the output size from (its index in the request and the image) and that size,
    (width, height); None for a family that does not, or a request without images.

    Run after `complete_images`: the image is picked in the model's role order, by its recorded role, and
    sized by its recorded (decoded) size.
    """
    if images.size_from is None or not request.images:
        return None
    roles = list(limits.image_roles)
    ordered = sorted(enumerate(request.images), key=lambda item: roles.index(ROLE_NAMES[item[1].role]))
    index, image = ordered[images.size_from.index]
    return (
        index,
        image,
        images.size_from.size(image.width, image.height, limits.height_multiple, limits.image_size_base),
    )


def verify_images(
    request: generation_pb2.GenerateRequest, limits: stages_pb2.ModelLimits, stop: Stop | None = None
) -> None:
    """Decodes every image whole; raises RequestError naming the first that does not decode, or that decodes to
    another size than its header gave (`complete_images` recorded that size, and an output size may have
    been made from it: neither would be the image's)."""
    for index, image in enumerate(request.images):
        decoded = decode_image(image.data, f"images[{index}].data", limits.max_image_pixels, stop)
        if decoded.size != (image.width, image.height):
            raise RequestError(
                f"images[{index}].data: the image decodes to {decoded.width}x{decoded.height}, not the "
                f"{image.width}x{image.height} its header gives; send the image already turned, without an "
                "EXIF orientation"
            )
