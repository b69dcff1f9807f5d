"""The FLUX.1 Kontext denoising loop, step for step as FluxKontextPipeline runs it.

It is FLUX.1's loop (families/flux/denoise.py: the seed's packed noise, the scheduler with the shift `mu` from
the noise's token count alone, the embedded guidance and true CFG, the unpacking) with the reference image in
the transformer's image sequence: on every step and in both guidance branches the image's packed latents
("image_latents", from the VAE's Encode) follow the noise latents, their position ids follow the noise's with
the first coordinate 1 (the noise's 0), and the prediction is cut back to the noise's tokens. The image's
latent grid comes from its decoded size, which the request carries (`DenoiseSpec.image_sizes`), as the VAE's
Encode sizes it (families/flux_kontext/vae_encode.py). Without an image the loop is FLUX.1's.

FLUX.1's parallel plan (families/flux/parallel.py) runs unchanged: it splits `hidden_states` and `img_ids` at
the transformer's input, which here are the joint sequence (noise then image tokens) and its ids, of the same
length, and gathers the whole joint sequence at `proj_out` before the cut.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import FluxKontextPipeline

from families.flux.denoise import FluxDenoiser, FluxText
from families.flux_kontext.family import FLUX_KONTEXT
from families.flux_kontext.vae_encode import LATENTS_NAME, reference_size
from stagekit.denoise import DenoiseSpec
from stagekit.model_options import TransformerOptions
from stagekit.parallel import ParallelConfig
from stagekit.parallel.mesh import refuse_unsupported_methods


class FluxKontextDenoiser(FluxDenoiser):
    """FLUX.1's denoiser with the reference image's latents in the sequence; one request at a time (the DiT
    stage's compute thread), so the request's image latents are held for the duration of `denoise`."""

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
        if parallel is not None and parallel.total_ranks > 1:
            # This family's refusals, before FLUX.1's and before reading any weight.
            refuse_unsupported_methods(parallel, FLUX_KONTEXT)
        super().__init__(model_dir, device, dtype, parallel=parallel, options=options, load_threads=load_threads)
        # The reference image's packed latents and their ids while `denoise` runs.
        self._image: tuple[torch.Tensor, torch.Tensor] | None = None

    def image_grid(self, spec: DenoiseSpec) -> tuple[int, int] | None:
        """(rows, columns) of the reference image's packed latents; None when the request sends no image,
        does not say its size, or sends one the pipeline cannot size."""
        if len(spec.image_roles) != 1 or len(spec.image_sizes) != 1:
            return None
        width, height = reference_size(*spec.image_sizes[0], self.vae_scale_factor)
        if width < 1 or height < 1:
            return None
        return height // self.vae_scale_factor // 2, width // self.vae_scale_factor // 2

    def image_tensor_shape(self, name: str, spec: DenoiseSpec) -> tuple[int | None, ...] | None:
        """The shape of "image_latents": [1, the image's tokens, the transformer's in_channels (4C)]."""
        grid = self.image_grid(spec) if name == LATENTS_NAME else None
        if grid is None:
            return None
        return (1, grid[0] * grid[1], self.transformer.config.in_channels)

    def _predict(
        self,
        latents: torch.Tensor,
        image_ids: torch.Tensor,
        timestep: torch.Tensor,
        guidance: torch.Tensor | None,
        text: FluxText,
        branch: str,
    ) -> torch.Tensor:
        if self._image is None:
            return super()._predict(latents, image_ids, timestep, guidance, text, branch)
        reference, reference_ids = self._image
        hidden = torch.cat([latents, reference], dim=1)
        ids = torch.cat([image_ids, reference_ids], dim=0)
        prediction = super()._predict(hidden, ids, timestep, guidance, text, branch)
        return prediction[:, : latents.size(1)]

    @torch.no_grad()
    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        """FLUX.1's loop with "image_latents" [1, N, 4C] in the sequence when the request sends an image;
        latents [1, C, 1, h, w].

        `conditioning`: FLUX.1's (each text's T5 sequence and CLIP pooled vector) and, with an image,
        "image_latents" of the image in `spec.image_sizes`.
        """
        if not spec.image_roles:
            return super().denoise(spec, conditioning, on_step, cancelled)
        image_latents = conditioning.get(LATENTS_NAME)
        grid = self.image_grid(spec)
        expected = self.image_tensor_shape(LATENTS_NAME, spec)
        if grid is None or image_latents is None or tuple(image_latents.shape) != expected:
            shape = None if image_latents is None else list(image_latents.shape)
            raise ValueError(f"image_latents {shape} do not fit the request's image (expected {expected})")
        dtype = self.transformer.dtype
        ids = FluxKontextPipeline._prepare_latent_image_ids(1, grid[0], grid[1], self.device, dtype)
        ids[..., 0] = 1
        self._image = (image_latents.to(self.device, dtype), ids)
        try:
            return super().denoise(spec, conditioning, on_step, cancelled)
        finally:
            self._image = None
