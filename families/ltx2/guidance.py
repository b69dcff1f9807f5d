"""LTX2Pipeline's guidance: its parameters besides guidance_scale, and how it combines a step's passes.

The pipeline guides in x0 space (x0 = latents - velocity * sigma), each modality with its own scales:
- CFG when the video or the audio CFG scale is above 1: the negative prompt's pass, `(scale - 1) * (pos - neg)`;
- STG when either STG scale is above 0: the positive prompt's pass with self-attention skipped in the
  `stg_blocks` (a transformer without perturbed attention, LTX-2.0's, runs them unchanged), `scale * (pos - stg)`;
- modality guidance when either modality scale is above 1: the positive pass with the audio-video
  cross-attention off, `(scale - 1) * (pos - isolated)`;
then the sum is rescaled towards the positive prediction's spread (rescale_noise_cfg) where the rescale is above 0.
A pass that runs adds its term to both modalities, whatever each one's scale. At guidance_scale 1 the audio's CFG
(7.0 by default) still runs the negative pass: only the video's CFG term is zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg


@dataclass(frozen=True)
class ModalityScales:
    """One modality's guidance: CFG, STG and modality scales and the rescale factor."""

    cfg: float
    stg: float
    modality: float
    rescale: float


@dataclass(frozen=True)
class LTX2Guidance:
    """LTX2Pipeline's call arguments besides guidance_scale that shape every step, at its __call__ defaults (LTX-2.3's
    suggested values): the guidance scales, the STG blocks, and how the transformer is conditioned (the
    cross-modality timestep, the motion speed). An audio value left at None (or 0, as the pipeline's `or` reads it)
    takes the video's."""

    stg_scale: float = 1.0
    modality_scale: float = 3.0
    guidance_rescale: float = 0.7
    audio_guidance_scale: float | None = 7.0
    audio_stg_scale: float | None = 1.0
    audio_modality_scale: float | None = 3.0
    audio_guidance_rescale: float | None = 0.7
    # spatio_temporal_guidance_blocks: the blocks whose self-attention the STG pass skips (28 suits LTX-2.3's 48
    # blocks, 29 LTX-2.0's); a block the transformer does not have is no block.
    stg_blocks: tuple[int, ...] = (28,)
    # The cross-modality sigma in the audio-video cross-attention's modulation (LTX-2.3 and later; False is
    # LTX-2.0's behaviour).
    use_cross_timestep: bool = True
    # The positional embeddings' frame rate is the playback frame rate over this.
    motion_speed: float = 1.0

    def __post_init__(self) -> None:
        if self.motion_speed <= 0:
            raise ValueError(f"motion_speed must be positive, not {self.motion_speed}")

    def scales(self, guidance_scale: float) -> tuple[ModalityScales, ModalityScales]:
        """(video, audio) scales for a request's guidance_scale, the audio ones defaulting as the pipeline's do;
        raises ValueError where the pipeline's check_inputs does (STG without blocks)."""
        video = ModalityScales(guidance_scale, self.stg_scale, self.modality_scale, self.guidance_rescale)
        audio = ModalityScales(
            self.audio_guidance_scale or guidance_scale,
            self.audio_stg_scale or self.stg_scale,
            self.audio_modality_scale or self.modality_scale,
            self.audio_guidance_rescale or self.guidance_rescale,
        )
        if (video.stg > 0 or audio.stg > 0) and not self.stg_blocks:
            raise ValueError("spatio-temporal guidance is on (an STG scale above 0) but no stg_blocks are given")
        return video, audio


def runs_cfg(video: ModalityScales, audio: ModalityScales) -> bool:
    return video.cfg > 1 or audio.cfg > 1


def runs_stg(video: ModalityScales, audio: ModalityScales) -> bool:
    return video.stg > 0 or audio.stg > 0


def runs_modality(video: ModalityScales, audio: ModalityScales) -> bool:
    return video.modality > 1 or audio.modality > 1


def guided_x0(
    positive: torch.Tensor,
    negative: torch.Tensor | None,
    stg: torch.Tensor | None,
    isolated: torch.Tensor | None,
    scales: ModalityScales,
) -> torch.Tensor:
    """One modality's guided x0 from the passes that ran (None for one that did not), as the pipeline sums and
    rescales them."""
    cfg_delta = 0.0 if negative is None else (scales.cfg - 1) * (positive - negative)
    stg_delta = 0.0 if stg is None else scales.stg * (positive - stg)
    modality_delta = 0.0 if isolated is None else (scales.modality - 1) * (positive - isolated)
    guided = positive + cfg_delta + stg_delta + modality_delta
    if scales.rescale > 0:
        return rescale_noise_cfg(guided, positive, guidance_rescale=scales.rescale)
    return guided


# A (video, audio) pair of packed tensors: video [1, T*h*w, C] and audio [1, A, Ca*M] (latents or a pass's x0).
VideoAudio = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Predictions:
    """One step's x0 predictions by pass; None for a pass that did not run."""

    positive: VideoAudio
    negative: VideoAudio | None
    stg: VideoAudio | None
    isolated: VideoAudio | None

    def guided(self, modality: int, scales: ModalityScales) -> torch.Tensor:
        """The guided x0 of one modality (0 video, 1 audio)."""

        def of(prediction: VideoAudio | None) -> torch.Tensor | None:
            return None if prediction is None else prediction[modality]

        return guided_x0(self.positive[modality], of(self.negative), of(self.stg), of(self.isolated), scales)
