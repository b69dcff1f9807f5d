"""Streaming tiled Wan VAE decode for devices too small for a whole frame's activations.

`AutoencoderKLWan.tiled_decode` cuts the latent video into overlapping spatial tiles, decodes each
tile over all frames with its own causal cache, and blends neighbouring tiles linearly over their
overlap (`blend_v` above, then `blend_h` to the left, in place, row by row). Decoding, blending and
cropping act on every frame on its own, so the same result can be streamed: `TiledDecodeSession`
keeps one causal cache per tile and, per latent frame, decodes every tile's slice of that frame and
blends the outputs exactly as the library does. It equals `tiled_decode` with the same tile sizes
(up to float rounding), not the untiled decode: each tile sees only its own latent window (zero
padding at tile borders, attention over the tile only), so pixels near tile borders differ from
the untiled decode and the blend only hides the seam. Use `PatchParallelDecodeSession` where the
result must equal the untiled decode.

Memory: activations peak at one tile's; the causal caches of all tiles stay alive between frames
(about the full frame's cache, times the overlap factor (min / stride) ** 2).
"""

from __future__ import annotations

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

from families.wan.decode import WanStreamingDecoder
from stagekit.decode import denormalize_latents, to_uint8_frames


class TiledDecodeSession:
    """One request's tiled decode, one latent frame at a time; tile sizes are in output pixels."""

    def __init__(
        self,
        decoder: WanStreamingDecoder,
        tile_sample_min_height: int = 256,
        tile_sample_min_width: int = 256,
        tile_sample_stride_height: int = 192,
        tile_sample_stride_width: int = 192,
    ) -> None:
        ratio = decoder.vae.spatial_compression_ratio
        for name, value in (
            ("tile_sample_min_height", tile_sample_min_height),
            ("tile_sample_min_width", tile_sample_min_width),
            ("tile_sample_stride_height", tile_sample_stride_height),
            ("tile_sample_stride_width", tile_sample_stride_width),
        ):
            if int(value) < ratio:
                raise ValueError(f"{name} must be at least the VAE's spatial compression ratio {ratio}, got {value}")
        if tile_sample_stride_height > tile_sample_min_height or tile_sample_stride_width > tile_sample_min_width:
            raise ValueError("tile strides must not exceed the tile sizes (tiles would leave gaps)")
        self.decoder = decoder
        self.tile_sample_min_height = int(tile_sample_min_height)
        self.tile_sample_min_width = int(tile_sample_min_width)
        self.tile_sample_stride_height = int(tile_sample_stride_height)
        self.tile_sample_stride_width = int(tile_sample_stride_width)
        self.latent_size: tuple[int, int] | None = None
        self.tile_caches: dict[tuple[int, int], list] = {}
        self.frames_decoded = 0
        self.latent_frames_seen = 0

    @torch.no_grad()
    def decode_next_float(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (normalised) to the clamped blended output [1, 3, n, H, W]."""
        owner = self.decoder
        vae = owner.vae
        patch_size = vae.config.patch_size
        ratio = vae.spatial_compression_ratio
        latents = latent_frame.to(owner.device, vae.dtype)
        z = denormalize_latents(latents, owner.latents_mean, owner.latents_std)
        height, width = z.shape[-2:]
        if self.latent_size is None:
            self.latent_size = (height, width)
        elif self.latent_size != (height, width):
            raise ValueError(f"latent frame is {height}x{width} but this request started at {self.latent_size}")

        # The same sizes as AutoencoderKLWan.tiled_decode.
        sample_height, sample_width = height * ratio, width * ratio
        tile_latent_min_height = self.tile_sample_min_height // ratio
        tile_latent_min_width = self.tile_sample_min_width // ratio
        tile_latent_stride_height = self.tile_sample_stride_height // ratio
        tile_latent_stride_width = self.tile_sample_stride_width // ratio
        tile_sample_stride_height = self.tile_sample_stride_height
        tile_sample_stride_width = self.tile_sample_stride_width
        if patch_size is not None:
            sample_height, sample_width = sample_height // patch_size, sample_width // patch_size
            tile_sample_stride_height //= patch_size
            tile_sample_stride_width //= patch_size
            blend_height = self.tile_sample_min_height // patch_size - tile_sample_stride_height
            blend_width = self.tile_sample_min_width // patch_size - tile_sample_stride_width
        else:
            blend_height = self.tile_sample_min_height - tile_sample_stride_height
            blend_width = self.tile_sample_min_width - tile_sample_stride_width

        first = self.latent_frames_seen == 0
        rows = []
        for i in range(0, height, tile_latent_stride_height):
            row = []
            for j in range(0, width, tile_latent_stride_width):
                cache = self.tile_caches.setdefault((i, j), [None] * owner.num_cached_convs)
                tile = z[:, :, :, i : i + tile_latent_min_height, j : j + tile_latent_min_width]
                tile = vae.post_quant_conv(tile)
                row.append(vae.decoder(tile, feat_cache=cache, feat_idx=[0], first_chunk=first))
            rows.append(row)
        self.latent_frames_seen += 1

        # Blend in the library's order: blend_v and blend_h write into the current tile, which later
        # serves as the (already blended) upper or left neighbour.
        result_rows = []
        for i, row in enumerate(rows):
            result_row = []
            for j, tile in enumerate(row):
                if i > 0:
                    tile = vae.blend_v(rows[i - 1][j], tile, blend_height)
                if j > 0:
                    tile = vae.blend_h(row[j - 1], tile, blend_width)
                result_row.append(tile[:, :, :, :tile_sample_stride_height, :tile_sample_stride_width])
            result_rows.append(torch.cat(result_row, dim=-1))
        out = torch.cat(result_rows, dim=3)[:, :, :, :sample_height, :sample_width]
        if patch_size is not None:
            out = unpatchify(out, patch_size=patch_size)
        out = torch.clamp(out, min=-1.0, max=1.0)
        self.frames_decoded += out.shape[2]
        return out

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (float32, normalised) to uint8 frames [n, H, W, 3]."""
        return to_uint8_frames(self.decode_next_float(latent_frame))
