"""LTX-2's VAE stage: the video latents to frames (AutoencoderKLLTX2Video) and the audio latents to a waveform
(AutoencoderKLLTX2Audio, then the vocoder), as LTX2Pipeline ends its __call__.

What arrives. The DiT stage's latents are already de-normalised (families/ltx2/denoise.py returns them as
`LTX2Pipeline(output_type="latent")` does: video `x * latents_std / scaling_factor + latents_mean`, audio
`x * latents_std + latents_mean`, unpacked), so nothing here normalises: the video latents [1, C, T, h, w] go to
`vae.decode` as they are, the audio latents [1, Ca, A, M] to `audio_vae.decode`.

Video. `vae.decode(latents, timestep)` gives [1, 3, 8 (T - 1) + 1, 32 h, 32 w] (latent frame 0 decodes to 1 frame,
each later one to 8), clamped to [-1, 1] and mapped to uint8 as the pipeline's video processor maps it to [0, 1]
(`stagekit.decode.to_uint8_frames`).

Why a session decodes the whole video at its last latent frame. The published decoders are not causal in time
(`decoder_causal: false` in the LTX-2.0 and LTX-2.3 configs; the pipeline decodes with the config's value): every
LTX2VideoCausalConv3d of the decoder pads time with a copy of its first frame before and of its last frame after,
so each frame depends on later latent frames, and the frames near the end on which latent frame is the last. With
the published block layouts, output frame 0 depends on latent frames 0-22 (LTX-2.0: five resnets per block) and
0-14 (LTX-2.3): at LTX2Pipeline's default 121 frames (16 latent frames) the first frame needs the last latent frame
(LTX-2.0) or the one before it (LTX-2.3) (tests/integration/test_ltx2_decode.py checks both). Nothing normalises
over time (the decoder's norms are per position, over channels), so a stream with that lookahead would be exact,
but at the default length it would send the first frames one latent frame early at best, and it pays only for
videos well past 23 latent frames (177 frames). So `LTX2DecodeSession` gathers the latent frames and decodes them
in one `vae.decode` when the last of the `num_latent_frames` it was opened for arrives: it returns no frames (uint8
[0, H, W, 3]) before that, and every frame then. Its peak memory is the library's whole decode.

Timestep conditioning. The published configs have `timestep_conditioning: false` (diffusers' conversion script
sets it only on request), and the pipeline then decodes with timestep None and draws no noise. A VAE with it is
decoded at the pipeline's default `decode_timestep` 0.0 (`DECODE_TIMESTEP`), where its `decode_noise_scale`
(defaulting to the timestep) is 0: the pipeline's `(1 - 0) * latents + 0 * noise` leaves the latents unchanged bit
for bit, so the noise it draws is not needed. (At another timestep the noise would be the seed's generator's next
draw, [1, C, T, h, w], after the video and the audio noise, the loop drawing nothing else, mixed into the latents
before their de-normalisation: the stage would need the seed, the audio latents' shape and the statistics. Requests
cannot set the timestep, so that is not built.)

Sound. `decode_audio` runs `audio_vae.decode` (a mel spectrogram [1, 2, 4 A - 3, mel bins]: the audio VAE is
causal and 4x in time) and the vocoder (LTX2Vocoder at 24 kHz, LTX-2.0; LTX2VocoderWithBWE, 16 kHz
bandwidth-extended to 48 kHz, LTX-2.3), giving the pipeline's `audio` [1, 2, samples] as float32 [2, samples] with
its sample rate. Its cost follows the sound's length, not the picture's size: on one CPU thread in float32, the
"small" preset's 33 frames at 256x384 (1.3 s of sound) take 1.0 s and 111 MiB of activations to decode as video and
0.35 s and 23 MiB as sound, most of it the vocoder; at the "tiny" 64x96 the bandwidth-extending vocoder costs more
than the video (0.1 s against 0.01 s).

Dtypes. Each model runs in the stage's dtype, the latents cast to it as the pipeline casts them. In float32 that is
the pipeline's arithmetic; in bfloat16 the pipeline casts the video latents before de-normalising them and the DiT
stage after, which rounds differently (by bfloat16 rounding, not more).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from torch import nn

from stagekit.decode import LatentDecoder, to_uint8_frames
from stagekit.weights import load_pretrained

# LTX2Pipeline's default decode_timestep (used only by a timestep-conditioned VAE; see the module's doc).
DECODE_TIMESTEP = 0.0
VOCODER_CLASSES: dict[str, type[nn.Module]] = {
    "LTX2Vocoder": LTX2Vocoder,
    "LTX2VocoderWithBWE": LTX2VocoderWithBWE,
}


def vocoder_class(folder: Path) -> type[nn.Module]:
    """The vocoder class named by the folder's config.json (LTX2Vocoder or LTX2VocoderWithBWE)."""
    name = json.loads((folder / "config.json").read_text()).get("_class_name")
    if name not in VOCODER_CLASSES:
        raise ValueError(f"{folder}: vocoder class {name!r} is not one of {', '.join(VOCODER_CLASSES)}")
    return VOCODER_CLASSES[name]


class LTX2AudioDecoder:
    """The audio VAE and the vocoder, from a checkpoint's audio_vae/ and vocoder/ folders."""

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, load_threads: int = 4) -> None:
        model_dir = Path(model_dir)
        self.device = device
        self.audio_vae = load_pretrained(
            AutoencoderKLLTX2Audio, model_dir / "audio_vae", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        folder = model_dir / "vocoder"
        self.vocoder = load_pretrained(
            vocoder_class(folder), folder, device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        self.sample_rate = int(self.vocoder.config.output_sampling_rate)
        config = self.audio_vae.config
        self.latent_channels = int(config.latent_channels)
        self.latent_mel_bins = int(config.mel_bins) // LATENT_DOWNSAMPLE_FACTOR
        # As the denoiser counts them: mel frames per second (sample rate over hop) over the audio VAE's 4x.
        self.latents_per_second = config.sample_rate / config.mel_hop_length / float(LATENT_DOWNSAMPLE_FACTOR)

    @torch.no_grad()
    def decode(self, audio_latents: torch.Tensor) -> tuple[np.ndarray, int]:
        """De-normalised audio latents [1, Ca, A, M] -> (waveform float32 [channels, samples], sample rate)."""
        if audio_latents.ndim != 4 or audio_latents.shape[0] != 1:
            raise ValueError(f"audio latents must be [1, channels, frames, mel bins], not {list(audio_latents.shape)}")
        latents = audio_latents.to(self.device, self.audio_vae.dtype)
        mel = self.audio_vae.decode(latents, return_dict=False)[0]
        waveform = self.vocoder(mel)
        return waveform[0].float().cpu().numpy(), self.sample_rate


class LTX2Decoder(LatentDecoder):
    """The VAE stage's models for LTX-2: the video VAE (`self.vae`) and the audio decoder (`self.audio`)."""

    vae_class = AutoencoderKLLTX2Video
    components = ("vae", "audio_vae", "vocoder")

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, load_threads: int = 4) -> None:
        # Not LatentDecoder's: the latents arrive de-normalised, and the config names its channels latent_channels.
        self.device = device
        self.vae = load_pretrained(
            self.vae_class, Path(model_dir) / "vae", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        self.latent_channels = int(self.vae.config.latent_channels)
        self.spatial_compression = int(self.vae.spatial_compression_ratio)
        self.audio = LTX2AudioDecoder(model_dir, device, dtype, load_threads)
        # stagekit.decode.AudioDecoder: what the VAE stage checks the DiT's audio latents against.
        self.audio_latent_channels = self.audio.latent_channels
        self.audio_latent_mel_bins = self.audio.latent_mel_bins
        self.audio_latents_per_second = self.audio.latents_per_second

    def session(self, num_latent_frames: int | None = None) -> LTX2DecodeSession:
        """One request's decode of `num_latent_frames` latent frames (the stage's DecodeParams.num_latent_frames),
        which LTX-2 cannot do without: its frames are decoded when the last latent frame arrives."""
        if num_latent_frames is None:
            raise ValueError("an LTX-2 decode session needs num_latent_frames: it decodes at the last latent frame")
        return LTX2DecodeSession(self, num_latent_frames)

    @torch.no_grad()
    def decode_video_float(self, latents: torch.Tensor) -> torch.Tensor:
        """De-normalised video latents [1, C, T, h, w] -> the decoder output [1, 3, 8 (T - 1) + 1, H, W] clamped to
        [-1, 1], as LTX2Pipeline decodes them."""
        latents = latents.to(self.device, self.vae.dtype)
        timestep = None
        if self.vae.config.timestep_conditioning:
            timestep = torch.tensor([DECODE_TIMESTEP], device=self.device, dtype=latents.dtype)
        video = self.vae.decode(latents, timestep, return_dict=False)[0]
        return video.clamp(-1.0, 1.0)

    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """De-normalised video latents [1, C, T, h, w] -> uint8 frames [8 (T - 1) + 1, H, W, 3]."""
        return to_uint8_frames(self.decode_video_float(latents))

    def decode_audio(self, audio_latents: torch.Tensor) -> tuple[np.ndarray, int]:
        """De-normalised audio latents [1, Ca, A, M] -> (waveform float32 [channels, samples], sample rate)."""
        return self.audio.decode(audio_latents)


class LTX2DecodeSession:
    """One request's video decode: its latent frames gathered until the last, then decoded in one call."""

    def __init__(self, decoder: LTX2Decoder, num_latent_frames: int) -> None:
        if num_latent_frames < 1:
            raise ValueError(f"num_latent_frames must be at least 1, not {num_latent_frames}")
        self.decoder = decoder
        self.num_latent_frames = num_latent_frames
        self.latent_frames: list[torch.Tensor] = []
        self.latent_frames_seen = 0
        self.frames_decoded = 0

    def decode_next_float(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Takes the next de-normalised latent frame [1, C, 1, h, w]; returns no frames ([1, 3, 0, H, W]) before the
        last, and at the last the whole video's decoder output [1, 3, n, H, W] clamped to [-1, 1]."""
        owner = self.decoder
        if self.latent_frames_seen == self.num_latent_frames:
            raise ValueError(f"the session's {self.num_latent_frames} latent frames have all been decoded")
        self.latent_frames.append(latent_frame.to(owner.device))
        self.latent_frames_seen += 1
        if self.latent_frames_seen < self.num_latent_frames:
            batch, _, _, height, width = latent_frame.shape
            scale = owner.spatial_compression
            return torch.zeros(batch, 3, 0, height * scale, width * scale, device=owner.device, dtype=owner.vae.dtype)
        latents = torch.cat(self.latent_frames, dim=2)
        self.latent_frames = []
        video = owner.decode_video_float(latents)
        self.frames_decoded += video.shape[2]
        return video

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Takes the next latent frame [1, C, 1, h, w]; returns uint8 frames [n, H, W, 3]: none before the last
        latent frame, every frame of the video at it."""
        return to_uint8_frames(self.decode_next_float(latent_frame))
