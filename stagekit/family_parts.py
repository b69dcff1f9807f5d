"""The types of a family's compute parts: what each `"module:attr"` of a `Family` (families/base.py) must name.

`Family.load(part)` imports a part and is typed by these protocols, so that a stage calling the part is
checked against the same signature every family's part is checked against (tests/unit/test_registry.py
imports every registered path and compares its signature with its protocol's `__call__`). A part that is a
class is called as its factory: the protocol's `__call__` is the constructor's signature, and the instance it
returns follows the stage protocol of stagekit/encoder.py, denoise.py or decode.py.

Rules: this module names torch and the stage protocols for type checkers only, so that families/base.py (no
torch at import time) can refer to it; `PART_PROTOCOLS` lists every part that `Family.load` takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from stagekit.decode import LatentDecoder
    from stagekit.denoise import Denoiser
    from stagekit.encoder import PromptEncoder
    from stagekit.images import DecodedImage
    from stagekit.model_options import TransformerOptions
    from stagekit.parallel import ParallelConfig

# The family declaration a checkpoint writer is handed (families.base.Family; stagekit does not import families).
FamilyT_contra = TypeVar("FamilyT_contra", contravariant=True)


class GeometryReader(Protocol):
    """`checkpoint_reader`: the CheckpointSpec fields a family reads from a checkpoint's configs (services/
    checkpoint.py), given {"vae", "transformer", "scheduler"} -> that component's config.json, and "model_index"
    -> model_index.json (the pipeline's own config entries)."""

    def __call__(self, configs: dict[str, dict[str, Any]]) -> dict[str, Any]: ...


class PromptEncoderFactory(Protocol):
    """`text_encoder`: builds the text-encoder stage's encoder (a stagekit.encoder.PromptEncoder)."""

    def __call__(
        self,
        model_dir: str | Path,
        model_id: str,
        device: torch.device,
        dtype: torch.dtype,
        cache_bytes: int = ...,
        cache_entries: int = ...,
        load_threads: int = ...,
    ) -> PromptEncoder: ...


class DenoiserFactory(Protocol):
    """`denoiser`: builds the DiT stage's denoiser (a stagekit.denoise.Denoiser; a BatchDenoiser where the family
    supports batching, an ImageDenoiser where it takes input images) with the rank's parallel layout and the
    stage's model options."""

    def __call__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        *,
        parallel: ParallelConfig | None = ...,
        options: TransformerOptions | None = ...,
        load_threads: int = ...,
    ) -> Denoiser: ...


class DecoderFactory(Protocol):
    """`decoder`: the constructor of the VAE stage's decoder, a subclass of stagekit.decode.LatentDecoder
    (`Family.load("decoder")` returns the class itself: patch-parallel ranks receive it pickled)."""

    def __call__(
        self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, load_threads: int = ...
    ) -> LatentDecoder: ...


class ImageLatentEncoder(Protocol):
    """The VAE stage's Encode of a request's input images, on its decoder's VAE: {name: tensor} of the
    conditioning slots the family makes from images (families.base.TensorSlot with `source="vae"`)."""

    def __call__(
        self, decoder: LatentDecoder, images: list[DecodedImage], height: int, width: int, num_frames: int
    ) -> dict[str, torch.Tensor]: ...


class ImageEncoderFactory(Protocol):
    """`image_encoder`: builds the `ImageLatentEncoder` of a checkpoint (families that take input images)."""

    def __call__(self, model_dir: str | Path) -> ImageLatentEncoder: ...


class CheckpointWriter(Protocol[FamilyT_contra]):
    """`writer`: `stagediff init-model`'s writer of a random-weight checkpoint of one preset into `out`;
    `save_kwargs` go to each component's `save_pretrained`."""

    def __call__(
        self, family: FamilyT_contra, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]
    ) -> None: ...


class GgufNames(Protocol):
    """`gguf_names`: the name GGUF files of the family give a diffusers state-dict key (families/gguf.py)."""

    def __call__(self, name: str) -> str: ...


# Every part `Family.load` takes -> the protocol its import path must satisfy.
PART_PROTOCOLS: dict[str, type] = {
    "checkpoint_reader": GeometryReader,
    "text_encoder": PromptEncoderFactory,
    "denoiser": DenoiserFactory,
    "decoder": DecoderFactory,
    "image_encoder": ImageEncoderFactory,
    "writer": CheckpointWriter,
    "gguf_names": GgufNames,
}
