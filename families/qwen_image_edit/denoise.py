"""The Qwen-Image-Edit denoising loop, step for step as QwenImageEditPipeline (and QwenImageEditPlusPipeline)
runs it.

It is Qwen-Image's loop (families/qwen_image/denoise.py: the seed's packed noise, the scheduler with the
shift `mu` from the noise's token count, true CFG with its norm-preserving rescale, the unpacking) with the
input images in the transformer's image sequence: on every step and in both guidance branches the
images' packed latents ("image_latents", from the VAE's Encode) follow the noise latents, `img_shapes`
gives the transformer the output's latent grid and then each image's, and the prediction is cut back to
the noise's tokens. The images' grids come from their decoded sizes, which the request carries
(`DenoiseSpec.image_sizes`), as the VAE's Encode sizes them (families/qwen_image_edit/vae_encode.py).

Qwen-Image's parallel plan runs unchanged: Ulysses and Ring split the whole image sequence (the noise
latents followed by the image latents) over their ranks, the text stream whole on each; CFG-parallel,
tensor parallel and HSDP as for Qwen-Image. What the family does not claim is refused before anything
loads (family.py says why).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from families.qwen_image.denoise import QwenImageDenoiser, QwenTextEmbeds
from families.qwen_image_edit.vae_encode import LATENTS_NAME, vae_image_size
from families.registry import family_for_index
from stagekit.denoise import DenoiseSpec
from stagekit.model_options import TransformerOptions
from stagekit.parallel import ParallelConfig
from stagekit.parallel.mesh import refuse_unsupported_methods


class QwenImageEditDenoiser(QwenImageDenoiser):
    """Qwen-Image's denoiser with the input images' latents in the sequence; one request at a time (the DiT
    stage's compute thread), so the request's image latents are held for the duration of `denoise`; its runs
    are not scheduled by the step (`runs_steps` False)."""

    runs_steps: ClassVar[bool] = False

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        *,
        parallel: ParallelConfig | None = None,
        options: TransformerOptions | None = None,
        load_threads: int = 4,
    ) -> None:
        family = family_for_index(json.loads((Path(model_dir) / "model_index.json").read_text()))
        assert family is not None  # the registry chose this class for the checkpoint's family
        self.family = family
        if parallel is not None and parallel.total_ranks > 1:
            # This family's refusals, before Qwen-Image's (which may run more) and before reading any weight.
            refuse_unsupported_methods(parallel, self.family)
        super().__init__(model_dir, device, dtype, parallel=parallel, options=options, load_threads=load_threads)
        self._images: tuple[torch.Tensor, list[tuple[int, int, int]]] | None = None

    def image_grids(self, spec: DenoiseSpec) -> list[tuple[int, int, int]] | None:
        """(1, rows, columns) of each input image's packed latents, the entries the pipelines add to
        `img_shapes`; None when the request does not say the images' sizes or one cannot be encoded."""
        if not spec.image_roles or len(spec.image_sizes) != len(spec.image_roles):
            return None
        grids = []
        for width, height in spec.image_sizes:
            vae_width, vae_height = vae_image_size(width, height)
            rows, columns = vae_height // self.vae_scale_factor // 2, vae_width // self.vae_scale_factor // 2
            if rows < 1 or columns < 1:
                return None
            grids.append((1, rows, columns))
        return grids

    def image_tensor_shape(self, name: str, spec: DenoiseSpec) -> tuple[int | None, ...] | None:
        """The shape of "image_latents": [1, the images' tokens, the transformer's in_channels (4 * z_dim)]."""
        grids = self.image_grids(spec) if name == LATENTS_NAME else None
        if grids is None:
            return None
        return (1, sum(rows * columns for _, rows, columns in grids), self.transformer.config.in_channels)

    def _predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, img_shapes: list, text: QwenTextEmbeds, branch: str
    ) -> torch.Tensor:
        if self._images is None:
            raise RuntimeError("the edit denoiser predicted outside denoise()")
        image_latents, grids = self._images
        hidden = torch.cat([latents, image_latents], dim=1)
        prediction = super()._predict(hidden, timestep, [[*img_shapes[0], *grids]], text, branch)
        return prediction[:, : latents.size(1)]

    @torch.no_grad()
    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        """Qwen-Image's loop with "image_latents" [1, N, 4C] in the sequence; latents [1, C, 1, h, w].

        `conditioning`: Qwen-Image's ("prompt_embeds", its mask, and with guidance_scale > 1 the negative
        prompt's), made with the images by the text encoder, and "image_latents" of the images in
        `spec.image_sizes`.
        """
        grids = self.image_grids(spec)
        image_latents = conditioning.get(LATENTS_NAME)
        expected = self.image_tensor_shape(LATENTS_NAME, spec)
        if grids is None or image_latents is None or tuple(image_latents.shape) != expected:
            shape = None if image_latents is None else list(image_latents.shape)
            raise ValueError(f"image_latents {shape} do not fit the request's images (expected {expected})")
        self._images = (image_latents.to(self.device, self.transformer.dtype), grids)
        try:
            return super().denoise(spec, conditioning, on_step, cancelled)
        finally:
            self._images = None
