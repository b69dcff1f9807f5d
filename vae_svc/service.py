"""gRPC servicer of the decoding stage.

The checkpoint's family names its decoder (families/<family>/decode.py: the streaming causal Wan VAE,
AutoencoderKLQwenImage for one image). Families that take input images name an image encoder too
(families/<family>/vae_encode.py), which the Encode RPC runs on the same VAE, on the compute thread
that decodes, so that encodes and decodes of different requests take turns on it.

Encode runs whole on one device, also in a patch-parallel group (on rank 0, which holds the whole VAE as
every rank does): the row-band machinery (vae_svc/patch_parallel.py) wraps the decoder's convolutions and
upsamplers, and the encoder's strided downsampling convolutions would need bands aligned to every stride
and their own halo widths. Encoding one or two frames is a small part of a request next to decoding the
whole video. Patch parallelism runs the family's decoder split by rows (vae_svc/group.py: the Wan VAE's causal
decoder, Qwen-Image's, and the 2D AutoencoderKL decoder of FLUX.1, Z-Image and FLUX.2 klein), tiling the Wan
VAE's causal decoder (vae_svc/tiled.py); a family that does not support them refuses the flags at startup with
the registry's reason.

A family that makes sound with its video (LTX-2: stagekit.decode.AudioDecoder, an audio VAE and a vocoder beside
the video VAE) gets one more tensor after the last latent frame, "audio_latents" [1, Ca, A, M] as the DiT sent it,
and answers it, after the last frames, with the waveform: one tensor "audio" FP32 [channels, samples] at
ModelLimits.audio_sample_rate. A decoder whose session returns no frames for a latent frame (LTX-2's decodes the
whole video at the last one, told which that is by DecodeParams.num_latent_frames) sends nothing for it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import torch

from services.environment_options import parse_args
from services.image_work import ImageWorkers
from services.images import Stop
from services.input_images import decode_stage_images
from services.memory_budget import WeightNeed, checkpoint_components, stage_need
from services.model_source import stage_model
from services.rank_group import GroupFailure
from services.stage import RequestError, StageRuntime, abort_for, parameter_bytes
from services.stage_main import StageServicer, run_stage
from services.torch_wire import encode_tensor, to_torch
from services.validation import validate_size
from stagediff.tensor_codec import TensorAssembler, WireError, WireTensor, expect_tensor
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from stagekit.decode import DecodeSession, LatentDecoder, decodes_audio, session_takes_frame_count
from stagekit.family_parts import ImageLatentEncoder
from stagekit.images import DecodedImage
from vae_svc.config import VaeConfig
from vae_svc.group import GroupDecodeSession, PatchParallelDecoder
from vae_svc.options import build_parser

if TYPE_CHECKING:
    from vae_svc.tiled import TiledDecodeSession

LATENT_DATATYPES = ("FP32", "BF16", "FP16")
AUDIO_LATENTS = "audio_latents"


class VaeDecoderServicer(stages_pb2_grpc.VaeDecoderServicer, StageServicer):
    service_name = stages_pb2.DESCRIPTOR.services_by_name["VaeDecoder"].full_name

    def __init__(self, config: VaeConfig, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.decode = config.decode
        self.threads = config.stage.threads
        self.patch_parallel_size = config.decode.patch_parallel_size
        self.decoder: LatentDecoder | PatchParallelDecoder | None = None
        self.image_encoder: ImageLatentEncoder | None = None
        self.image_workers = ImageWorkers()  # the input images of Encode are decoded there
        # Each rank needs at least one latent row: the smallest height that splits over every rank.
        multiple = runtime.checkpoint.height_multiple
        rows = self.patch_parallel_size * runtime.checkpoint.vae_scale_spatial
        runtime.min_height = -(-rows // multiple) * multiple

    def add_to_server(self, server: grpc.aio.Server) -> None:
        stages_pb2_grpc.add_VaeDecoderServicer_to_server(self, server)

    @property
    def _loaded(self) -> LatentDecoder | PatchParallelDecoder:
        """The decoder: the RPCs refuse calls until `load` has set it."""
        assert self.decoder is not None, "vae: used before its model loaded"
        return self.decoder

    def load(self) -> None:
        runtime, spec, tile = self.runtime, self.runtime.checkpoint, self.decode.tile
        decoder_class = spec.traits.load("decoder")
        decoder: LatentDecoder | PatchParallelDecoder
        if self.patch_parallel_size > 1:
            decoder = PatchParallelDecoder(
                spec.path,
                runtime.device,
                runtime.dtype,
                self.threads,
                self.patch_parallel_size,
                decoder_class=decoder_class,
            )
            devices = (
                ", ".join(f"cuda:{rank}" for rank in range(self.patch_parallel_size))
                if runtime.device.type == "cuda"
                else f"cpu x {self.patch_parallel_size} processes"
            )
            runtime.parallel_config = {
                "world_size": str(self.patch_parallel_size),
                "vae_patch_parallel_size": str(self.patch_parallel_size),
                "split": "rows (height), halo exchange before each spatial convolution",
                "devices": devices,
            }
        else:
            decoder = decoder_class(spec.path, runtime.device, runtime.dtype, load_threads=runtime.load_threads)
            if self.decode.use_tiling:
                runtime.parallel_config = {
                    "tiling": "approximate: tiles decoded separately and blended",
                    "tile": f"{tile.min_height}x{tile.min_width}",
                    "stride": f"{tile.stride_height}x{tile.stride_width}",
                }
        self.decoder = decoder
        runtime.parameter_bytes = {"vae": parameter_bytes(decoder.vae)}
        if spec.traits.image_encoder:
            self.image_encoder = spec.traits.load("image_encoder")(spec.path)

    def memory_need(self) -> WeightNeed:
        """The VAE in the stage's dtype; on the CPU every rank of a patch-parallel group holds a whole copy."""
        runtime = self.runtime
        on_cpu = runtime.device.type == "cpu"
        copies = self.patch_parallel_size if on_cpu else 1
        fixes = []
        if on_cpu and copies > 1:
            fixes.append(f"a smaller --vae-patch-parallel-size (now {copies}: each CPU rank holds the whole VAE)")
        # The decoder's components: the VAE, and for a family that makes sound its audio VAE and vocoder too.
        names = runtime.checkpoint.traits.load("decoder").components
        components = checkpoint_components(runtime.checkpoint.path, names=names)
        return stage_need(runtime.stage, runtime.device, runtime.dtype, components, copies=copies, fixes=fixes)

    def _open_session(self, num_latent_frames: int) -> DecodeSession | GroupDecodeSession | TiledDecodeSession:
        decoder = self._loaded
        if self.decode.use_tiling:
            from families.wan.decode import WanStreamingDecoder
            from vae_svc.tiled import TiledDecodeSession

            # Startup refuses --vae-use-tiling for a family whose decoder is not Wan's.
            assert isinstance(decoder, WanStreamingDecoder)
            tile = self.decode.tile
            return TiledDecodeSession(decoder, tile.min_height, tile.min_width, tile.stride_height, tile.stride_width)
        if session_takes_frame_count(decoder):
            # A decoder that decodes at the last latent frame (LTX-2's) is told which one that is.
            return decoder.session(num_latent_frames=num_latent_frames)  # type: ignore[call-arg]
        return decoder.session()

    def _check_audio_latents(self, tensor: WireTensor, received: int, num_latent_frames: int, seen: bool) -> None:
        """The audio latents of a model that makes sound: once, after every latent frame, [1, Ca, A, M] with A at
        most the sound of the longest video the model allows at its default frame rate."""
        spec, decoder = self.runtime.checkpoint, self._loaded
        if not decodes_audio(decoder):
            raise WireError(f"tensor '{AUDIO_LATENTS}': model '{spec.model_id}' ({spec.family}) makes no sound")
        if seen:
            raise WireError(f"tensor '{AUDIO_LATENTS}': sent twice; send it once, after the last latent frame")
        if received != num_latent_frames:
            raise WireError(
                f"tensor '{AUDIO_LATENTS}': arrived after {received} of the {num_latent_frames} latent frames; send "
                "it after the last"
            )
        expect_tensor(tensor, name=AUDIO_LATENTS, datatypes=LATENT_DATATYPES, ndim=4)
        channels, mel_bins = decoder.audio_latent_channels, decoder.audio_latent_mel_bins
        max_frames = math.ceil(spec.max_frames / spec.defaults.fps * decoder.audio_latents_per_second)
        batch, got_channels, frames, got_mel_bins = tensor.shape
        if batch != 1 or got_channels != channels or got_mel_bins != mel_bins or not 1 <= frames <= max_frames:
            raise WireError(
                f"tensor '{AUDIO_LATENTS}': shape {list(tensor.shape)} is not allowed; expected [1, {channels}, A, "
                f"{mel_bins}] with 1 <= A <= {max_frames}"
            )
        if tensor.index != 0:
            raise WireError(f"tensor '{AUDIO_LATENTS}': index {tensor.index}; send it whole, at index 0")

    def _decode_audio(self, audio_latents: torch.Tensor) -> torch.Tensor:
        decoder = self._loaded
        assert decodes_audio(decoder)  # `_check_audio_latents` refused the tensor otherwise
        waveform, _ = decoder.decode_audio(audio_latents)
        return torch.from_numpy(waveform).float()

    def failure(self) -> str | None:
        return self.decoder.failure() if isinstance(self.decoder, PatchParallelDecoder) else None

    def close(self) -> None:
        if isinstance(self.decoder, PatchParallelDecoder):
            self.decoder.close()

    def _check_latent(self, tensor: WireTensor, expected_index: int, first: WireTensor | None) -> None:
        spec, latent_channels = self.runtime.checkpoint, self._loaded.latent_channels
        expect_tensor(tensor, name="latents", datatypes=LATENT_DATATYPES, ndim=5)
        batch, channels, frames, height, width = tensor.shape
        if batch != 1 or channels != latent_channels or frames != 1:
            raise WireError(
                f"tensor 'latents': shape {list(tensor.shape)} is not allowed; send one latent frame per tensor, "
                f"[1, {latent_channels}, 1, h, w]"
            )
        max_h, max_w = spec.max_height // spec.vae_scale_spatial, spec.max_width // spec.vae_scale_spatial
        if not (1 <= height <= max_h and 1 <= width <= max_w):
            raise WireError(f"tensor 'latents': h={height}, w={width} out of range; allowed 1..{max_h}, 1..{max_w}")
        if height < self.patch_parallel_size:
            raise WireError(
                f"tensor 'latents': h={height} rows cannot be split over {self.patch_parallel_size} patch-parallel "
                f"ranks; each needs a row, so h >= {self.patch_parallel_size} (height >= {self.runtime.min_height})"
            )
        if first is not None and tensor.shape != first.shape:
            raise WireError(
                f"tensor 'latents': frame {tensor.index} has shape {list(tensor.shape)}, "
                f"but frame 0 had {list(first.shape)}; every latent frame must have the same shape"
            )
        if tensor.index != expected_index:
            raise WireError(f"tensor 'latents': index {tensor.index} arrived where {expected_index} was expected")

    async def Decode(
        self,
        request_iterator: AsyncIterator[stages_pb2.DecodeRequest],
        context: grpc.aio.ServicerContext[stages_pb2.DecodeRequest, stages_pb2.DecodeResponse],
    ) -> AsyncIterator[stages_pb2.DecodeResponse]:
        if self.decoder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "vae: still loading its model")
        spec = self.runtime.checkpoint
        max_latent_frames = (spec.max_frames - 1) // spec.vae_scale_temporal + 1
        try:
            params: stages_pb2.DecodeParams | None = None
            assembler = TensorAssembler()
            session: DecodeSession | TiledDecodeSession | GroupDecodeSession | None = None
            first: WireTensor | None = None
            received = 0
            audio_sent = False
            async for request in request_iterator:
                if request.HasField("params"):
                    if params is not None:
                        raise RequestError("params: sent twice; send params once, first")
                    params = request.params
                    self.runtime.check_model(params.model)
                    if not 1 <= params.num_latent_frames <= max_latent_frames:
                        raise RequestError(
                            f"num_latent_frames: {params.num_latent_frames} is not allowed; "
                            f"use 1 to {max_latent_frames}"
                        )
                    session = self._open_session(params.num_latent_frames)
                    continue
                if not request.HasField("tensor"):
                    raise RequestError("part: each message must set params or tensor")
                if params is None or session is None:
                    raise RequestError("params: must be the first message, before any tensor")
                tensor = assembler.feed(request.tensor)
                if tensor is None:
                    continue
                if tensor.name == AUDIO_LATENTS:
                    self._check_audio_latents(tensor, received, params.num_latent_frames, audio_sent)
                    audio_sent = True
                    waveform = await self.runtime.run(self._decode_audio, to_torch(tensor))
                    for chunk in encode_tensor("audio", waveform, index=0):
                        yield stages_pb2.DecodeResponse(tensor=chunk)
                    continue
                if received >= params.num_latent_frames:
                    raise WireError(f"tensor 'latents': more than the {params.num_latent_frames} frames announced")
                self._check_latent(tensor, received, first)
                first = first or tensor
                received += 1
                first_frame = session.frames_decoded
                frames = await self.runtime.run(session.decode_next, to_torch(tensor))
                if frames.shape[0] == 0:
                    continue  # a decoder that decodes later (LTX-2's, at the last latent frame) has none yet
                for chunk in encode_tensor("frames", frames, index=first_frame):
                    yield stages_pb2.DecodeResponse(tensor=chunk)
            assembler.finish()
            if params is None:
                raise RequestError("params: missing; the first message must carry DecodeParams")
            if received != params.num_latent_frames:
                raise WireError(f"tensor 'latents': {received} of the {params.num_latent_frames} announced frames came")
            if decodes_audio(self._loaded) and not audio_sent:
                raise WireError(
                    f"tensor '{AUDIO_LATENTS}': missing; model '{spec.model_id}' makes sound, so send its audio "
                    "latents after the last latent frame"
                )
        except GroupFailure as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"vae: {error}")
        except Exception as error:
            await abort_for(error, context, self.runtime.stage)
        finally:
            # A group session holds state on every rank until it is closed.
            if isinstance(session, GroupDecodeSession) and self.failure() is None:
                await self.runtime.run(session.close)

    def _encode_inputs(self, request: stages_pb2.VaeEncodeRequest, stop: Stop) -> list[DecodedImage]:
        """Checks an Encode request against the model and decodes its images, in the model's role order."""
        spec = self.runtime.checkpoint
        self.runtime.check_model(request.model)
        if self.image_encoder is None:
            raise RequestError(f"images: model '{spec.model_id}' ({spec.family}) takes no input images")
        validate_size(spec.limits(), request.height, request.width, request.num_frames)
        if not request.images:
            raise RequestError("images: empty; send the images to encode")
        return decode_stage_images(request.images, spec, stop)

    def _encode(self, request: stages_pb2.VaeEncodeRequest, images: list[DecodedImage]) -> dict[str, torch.Tensor]:
        # A patch-parallel group's rank 0 holds the whole VAE, and encodes on it alone (see the module's doc).
        decoder = self._loaded
        if isinstance(decoder, PatchParallelDecoder):
            decoder = decoder.worker.decoder
        assert self.image_encoder is not None  # `_encode_inputs` refused the request otherwise
        return self.image_encoder(decoder, images, request.height, request.width, request.num_frames)

    async def Encode(
        self,
        request: stages_pb2.VaeEncodeRequest,
        context: grpc.aio.ServicerContext[stages_pb2.VaeEncodeRequest, stages_pb2.VaeEncodeResponse],
    ) -> AsyncIterator[stages_pb2.VaeEncodeResponse]:
        if self.decoder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "vae: still loading its model")
        try:
            images = await self.image_workers.run(functools.partial(self._encode_inputs, request))
            latents = await self.runtime.run(self._encode, request, images)
        except Exception as error:
            await abort_for(error, context, self.runtime.stage)
        for name, tensor in latents.items():
            for chunk in encode_tensor(name, tensor):
                yield stages_pb2.VaeEncodeResponse(tensor=chunk)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv)
    args.model = stage_model("vae", args.model)
    args.also_serve = [stage_model("vae", path, "--also-serve") for path in args.also_serve]
    config = VaeConfig.from_args(args)
    run_stage(config.stage, functools.partial(VaeDecoderServicer, config))


if __name__ == "__main__":
    main()
