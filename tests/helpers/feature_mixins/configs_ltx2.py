"""LTX-2's tester config (tests/helpers/feature_mixins/base.py says what a config declares).

The DiT stage sends LTX-2's video latents and then its audio latents (families/ltx2/denoise.py `denoise_av`), so the
latents every check compares are both: the video's and the audio's, flattened one after the other (`denoised`,
`initial_noise`). A feature that changed only the audio stream of the joint blocks, or the audio's input and output
layers, fails the checks as one that changed the video does.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

from families.ltx2.checkpoint import FPS
from stagekit.denoise import DenoiseSpec
from tests.helpers.feature_mixins.base import FamilyTesterConfig
from tests.helpers.feature_mixins.configs import HSDP2

# Text tokens of both prompts in `spec`'s conditioning (the text encoder pads the prompt and the negative prompt to
# one length); the connectors' registers make every position real, so the mask is all ones.
TEXT_LENGTH = 12


def both_modalities(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """The video latents [1, C, T, h, w] and the audio latents [1, Ca, A, M] as one flat tensor, video first."""
    return torch.cat([video.flatten(), audio.flatten()])


class LTX2TesterConfig(FamilyTesterConfig):
    """LTX-2 text-to-audio+video on the tiny checkpoint (LTX-2.3's layout): two steps at LTX2Pipeline's default
    guidance, so each step runs the negative and positive prompts as one batch, then the STG pass and the
    modality-isolated pass (three forwards); 64x64x9 at 24 fps is 2 x 2 x 2 video tokens and 9 audio tokens."""

    family = "ltx-2"
    pipeline_class = LTX2Pipeline
    spec = DenoiseSpec(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=3.0, seed=0)
    forwards_per_expert = [6]
    expert_names = ("transformer",)
    transformer_class = LTX2VideoTransformer3DModel
    blocks_attribute = "transformer_blocks"
    # The video's output layer (is_ignored keeps "proj_out" always), the audio's, one joint block and the audio's
    # timestep embedding.
    ignored_layers = ("proj_out", "audio_proj_out", "transformer_blocks.0.*", "audio_time_embed.*")
    ignored_prefixes = ("audio_proj_out", "transformer_blocks.0.", "audio_time_embed.")
    min_reference_std = 0.1
    # The tiny linears take 16 to 128 inputs: each output row keeps a bf16 bias and scale (4 bytes) beside its 16 to
    # 128 bytes of 8-bit weights, so torchao's quantized transformer holds 56% (fp8) and 57% (int8) of its bf16 bytes;
    # at the published widths (4096 inputs and more) those rows add under 0.1%.
    max_quantized_fraction = 0.6
    # The default guidance sums CFG (the audio's at 7), STG and modality terms, each a difference of two quantized
    # predictions: FP8 of every linear moves the update by 6.3% (video 6.0%, audio 6.4%; 4.5% with plain CFG at 3 for
    # both modalities), INT8 by 3.5%.
    quantized_limit = 0.07
    # HSDP is the family's only parallel method (families/ltx2/parallel.py): each rank's video and audio latents are
    # one rank's.
    parallel_layouts = {2: [HSDP2]}

    # Video tokens 8 and audio tokens 9, then 18 and 18, then 12 and 9, 32 and 26, each with its own text length
    # (compile_text_lengths); every request runs the batch of two texts, the STG pass and the isolated pass. No
    # class runs CompileTesterMixin on them yet: the compiled blocks give the eager latents of both modalities (within
    # 1.1e-5) and the later sizes compile nothing more, but the six graphs take minutes to compile on a CPU.
    compile_specs = (
        spec,
        DenoiseSpec(height=64, width=96, num_frames=17, num_inference_steps=2, guidance_scale=4.0, seed=1),
        DenoiseSpec(height=96, width=64, num_frames=9, num_inference_steps=2, guidance_scale=1.0, seed=2),
        DenoiseSpec(height=64, width=128, num_frames=25, num_inference_steps=2, guidance_scale=3.0, seed=3),
    )
    compile_text_lengths = (TEXT_LENGTH, 7, 20, 5)

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        """Both texts' video and audio embeddings with their mask, as the DiT stage receives them."""
        return self._texts(denoiser, TEXT_LENGTH, torch.Generator().manual_seed(spec.seed))

    def compile_conditioning(self, denoiser: Any, index: int) -> dict[str, torch.Tensor]:
        """Both texts at `compile_text_lengths[index]` tokens."""
        generator = torch.Generator().manual_seed(100 + index)
        return self._texts(denoiser, self.compile_text_lengths[index], generator)

    @staticmethod
    def _texts(denoiser: Any, length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        tensors = {}
        for role in ("prompt", "negative_prompt"):
            tensors[f"{role}_video_embeds"] = torch.randn(1, length, denoiser.text_dim, generator=generator)
            tensors[f"{role}_audio_embeds"] = torch.randn(1, length, denoiser.audio_text_dim, generator=generator)
            tensors[f"{role}_embeds_mask"] = torch.ones(1, length, dtype=torch.long)
        return tensors

    def denoised(self, denoiser: Any, spec: DenoiseSpec, conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        """The video latents and the audio latents the DiT stage sends, as one flat tensor."""
        return both_modalities(*denoiser.denoise_av(spec, conditioning, lambda step, total: None, lambda: False))

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        """The seed's video and audio noise de-normalised as the final latents are, in `denoised`'s layout."""
        grid = denoiser.latent_grid(self.spec, self.spec.fps or FPS)
        video, audio = denoiser.initial_noise(self.spec, grid)
        return both_modalities(*denoiser.output_latents(denoiser.pack_video(video), denoiser.pack_audio(audio), grid))
