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
decoder and Qwen-Image's), tiling the Wan VAE's causal decoder (vae_svc/tiled.py); a family that does not
support them refuses the flags at startup with the registry's reason.
"""

from __future__ import annotations

import argparse
import functools

import grpc
import torch

from families.base import Family
from services.checkpoint import CheckpointError, read_checkpoint
from services.environment_options import parse_args
from services.image_work import ImageWorkers
from services.images import Stop
from services.input_images import DecodedImage, decode_stage_images
from services.memory_budget import WeightNeed, checkpoint_components, stage_need
from services.rank_group import GroupFailure
from services.stage import RequestError, StageRuntime, abort_for, parameter_bytes
from services.stage_main import StageServicer, run_stage
from services.torch_wire import encode_tensor, to_torch
from services.validation import validate_size
from stagediff.tensor_codec import TensorAssembler, WireError, WireTensor, expect_tensor
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from vae_svc.decode import DecodeSession, LatentDecoder
from vae_svc.group import GroupDecodeSession, PatchParallelDecoder
from vae_svc.options import build_parser
from vae_svc.tiled import TiledDecodeSession

LATENT_DATATYPES = ("FP32", "BF16", "FP16")


class VaeDecoderServicer(stages_pb2_grpc.VaeDecoderServicer, StageServicer):
    service_name = stages_pb2.DESCRIPTOR.services_by_name["VaeDecoder"].full_name

    def __init__(self, args: argparse.Namespace, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.args = args
        self.patch_parallel_size = args.vae_patch_parallel_size
        self.decoder: LatentDecoder | PatchParallelDecoder | None = None
        self.image_encoder = None
        self.image_workers = ImageWorkers()  # the input images of Encode are decoded there
        # Each rank needs at least one latent row: the smallest height that splits over every rank.
        multiple = runtime.spec.height_multiple
        rows = self.patch_parallel_size * runtime.spec.vae_scale_spatial
        runtime.min_height = -(-rows // multiple) * multiple

    def add_to_server(self, server: grpc.aio.Server) -> None:
        stages_pb2_grpc.add_VaeDecoderServicer_to_server(self, server)

    def load(self) -> None:
        runtime, args = self.runtime, self.args
        if self.patch_parallel_size > 1:
            self.decoder = PatchParallelDecoder(
                runtime.spec.path, runtime.device, runtime.dtype, args.threads, self.patch_parallel_size
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
            decoder_class = runtime.spec.traits.load("decoder")
            self.decoder = decoder_class(
                runtime.spec.path, runtime.device, runtime.dtype, load_threads=runtime.load_threads
            )
            if args.vae_use_tiling:
                runtime.parallel_config = {
                    "tiling": "approximate: tiles decoded separately and blended",
                    "tile": f"{args.vae_tile_sample_min_height}x{args.vae_tile_sample_min_width}",
                    "stride": f"{args.vae_tile_sample_stride_height}x{args.vae_tile_sample_stride_width}",
                }
        runtime.parameter_bytes = {"vae": parameter_bytes(self.decoder.vae)}
        if runtime.spec.traits.image_encoder:
            self.image_encoder = runtime.spec.traits.load("image_encoder")(runtime.spec.path)

    def memory_need(self) -> WeightNeed:
        """The VAE in the stage's dtype; on the CPU every rank of a patch-parallel group holds a whole copy."""
        runtime = self.runtime
        on_cpu = runtime.device.type == "cpu"
        copies = self.patch_parallel_size if on_cpu else 1
        fixes = []
        if on_cpu and copies > 1:
            fixes.append(f"a smaller --vae-patch-parallel-size (now {copies}: each CPU rank holds the whole VAE)")
        components = checkpoint_components(runtime.spec.path, names=("vae",))
        return stage_need(runtime.stage, runtime.device, runtime.dtype, components, copies=copies, fixes=fixes)

    def _open_session(self):
        if self.args.vae_use_tiling:
            args = self.args
            return TiledDecodeSession(
                self.decoder,
                args.vae_tile_sample_min_height,
                args.vae_tile_sample_min_width,
                args.vae_tile_sample_stride_height,
                args.vae_tile_sample_stride_width,
            )
        return self.decoder.session()

    def failure(self) -> str | None:
        return self.decoder.failure() if isinstance(self.decoder, PatchParallelDecoder) else None

    def close(self) -> None:
        if isinstance(self.decoder, PatchParallelDecoder):
            self.decoder.close()

    def _check_latent(self, tensor: WireTensor, expected_index: int, first: WireTensor | None) -> None:
        spec = self.runtime.spec
        expect_tensor(tensor, name="latents", datatypes=LATENT_DATATYPES, ndim=5)
        batch, channels, frames, height, width = tensor.shape
        if batch != 1 or channels != self.decoder.latent_channels or frames != 1:
            raise WireError(
                f"tensor 'latents': shape {list(tensor.shape)} is not allowed; send one latent frame per tensor, "
                f"[1, {self.decoder.latent_channels}, 1, h, w]"
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

    async def Decode(self, request_iterator, context):
        if self.decoder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "vae: still loading its model")
        max_latent_frames = (self.runtime.spec.max_frames - 1) // self.runtime.spec.vae_scale_temporal + 1
        try:
            params: stages_pb2.DecodeParams | None = None
            assembler = TensorAssembler()
            session: DecodeSession | TiledDecodeSession | GroupDecodeSession | None = None
            first: WireTensor | None = None
            received = 0
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
                    session = self._open_session()
                    continue
                if not request.HasField("tensor"):
                    raise RequestError("part: each message must set params or tensor")
                if params is None or session is None:
                    raise RequestError("params: must be the first message, before any tensor")
                tensor = assembler.feed(request.tensor)
                if tensor is None:
                    continue
                if received >= params.num_latent_frames:
                    raise WireError(f"tensor 'latents': more than the {params.num_latent_frames} frames announced")
                self._check_latent(tensor, received, first)
                first = first or tensor
                received += 1
                first_frame = session.frames_decoded
                frames = await self.runtime.run(session.decode_next, to_torch(tensor))
                for chunk in encode_tensor("frames", frames, index=first_frame):
                    yield stages_pb2.DecodeResponse(tensor=chunk)
            assembler.finish()
            if params is None:
                raise RequestError("params: missing; the first message must carry DecodeParams")
            if received != params.num_latent_frames:
                raise WireError(f"tensor 'latents': {received} of the {params.num_latent_frames} announced frames came")
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
        spec = self.runtime.spec
        self.runtime.check_model(request.model)
        if self.image_encoder is None:
            raise RequestError(f"images: model '{spec.model_id}' ({spec.family}) takes no input images")
        validate_size(spec.limits(), request.height, request.width, request.num_frames)
        if not request.images:
            raise RequestError("images: empty; send the images to encode")
        return decode_stage_images(request.images, spec, stop)

    def _encode(self, request: stages_pb2.VaeEncodeRequest, images: list[DecodedImage]) -> dict[str, torch.Tensor]:
        # A patch-parallel group's rank 0 holds the whole VAE, and encodes on it alone (see the module's doc).
        decoder = self.decoder.worker.decoder if isinstance(self.decoder, PatchParallelDecoder) else self.decoder
        return self.image_encoder(decoder, images, request.height, request.width, request.num_frames)

    async def Encode(self, request, context):
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


def check_decode_arguments(args: argparse.Namespace) -> None:
    """Refuses impossible decode settings at startup, naming what is allowed."""
    if args.vae_patch_parallel_size < 1:
        raise SystemExit(f"stagediff serve vae: --vae-patch-parallel-size {args.vae_patch_parallel_size}: must be >= 1")
    if args.vae_use_tiling and args.vae_patch_parallel_size > 1:
        raise SystemExit(
            "stagediff serve vae: --vae-use-tiling and --vae-patch-parallel-size > 1 are exclusive: "
            "patch parallel is exact and spreads memory over ranks; tiling is approximate, for one device"
        )
    for name in ("height", "width"):
        size = getattr(args, f"vae_tile_sample_min_{name}")
        stride = getattr(args, f"vae_tile_sample_stride_{name}")
        if args.vae_use_tiling and not 0 < stride <= size:
            raise SystemExit(
                f"stagediff serve vae: --vae-tile-sample-stride-{name} {stride} must be in 1..{size} "
                f"(the tile {name}), so that tiles overlap or touch"
            )
    family = _family_of(args.model)
    for used, flag, feature in (
        (args.vae_patch_parallel_size > 1, "--vae-patch-parallel-size", "vae_patch_parallel"),
        (args.vae_use_tiling, "--vae-use-tiling", "vae_tiling"),
    ):
        if used and family is not None and not family.support(feature).supported:
            raise SystemExit(
                f"stagediff serve vae: the {family.name} family does not support {flag}: "
                f"{family.support(feature).reason}"
            )
    if args.device.startswith("cuda") and args.vae_patch_parallel_size > torch.cuda.device_count():
        raise SystemExit(
            f"stagediff serve vae: --vae-patch-parallel-size {args.vae_patch_parallel_size} needs that many GPUs; "
            f"{torch.cuda.device_count()} are visible"
        )


def _family_of(model: str) -> Family | None:
    try:
        return read_checkpoint(model).traits
    except CheckpointError:
        return None  # the stage itself reports what is wrong with the checkpoint


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv)
    check_decode_arguments(args)
    run_stage("vae", args, VaeDecoderServicer)


if __name__ == "__main__":
    main()
