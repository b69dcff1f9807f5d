"""The decoded input image a stage hands to a family's compute (services/input_images.py decodes and checks it)."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image


@dataclass(frozen=True)
class DecodedImage:
    """One request image after its checks: its role name, the RGB image and the sha256 of its encoded bytes."""

    role: str
    image: Image.Image  # RGB
    sha256: str
