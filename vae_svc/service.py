"""gRPC servicer of the decoding stage."""

from __future__ import annotations

import argparse

import grpc

from services.stage import RequestError, StageRuntime, abort_for, parameter_bytes
from services.stage_main import StageServicer, add_stage_arguments, run_stage
from services.tensor_codec import TensorAssembler, WireError, WireTensor, encode_tensor, expect_tensor
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from vae_svc.decode import DecodeSession, WanStreamingDecoder

LATENT_DATATYPES = ("FP32", "BF16", "FP16")


class VaeDecoderServicer(stages_pb2_grpc.VaeDecoderServicer, StageServicer):
    service_name = stages_pb2.DESCRIPTOR.services_by_name["VaeDecoder"].full_name

    def __init__(self, args: argparse.Namespace, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.decoder: WanStreamingDecoder | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        stages_pb2_grpc.add_VaeDecoderServicer_to_server(self, server)

    def load(self) -> None:
        self.decoder = WanStreamingDecoder(self.runtime.spec.path, self.runtime.device, self.runtime.dtype)
        self.runtime.parameter_bytes = {"vae": parameter_bytes(self.decoder.vae)}

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
            session: DecodeSession | None = None
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
                    session = self.decoder.session()
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
                frames = await self.runtime.run(session.decode_next, tensor.to_torch())
                for chunk in encode_tensor("frames", frames, index=first_frame):
                    yield stages_pb2.DecodeResponse(tensor=chunk)
            assembler.finish()
            if params is None:
                raise RequestError("params: missing; the first message must carry DecodeParams")
            if received != params.num_latent_frames:
                raise WireError(f"tensor 'latents': {received} of the {params.num_latent_frames} announced frames came")
        except Exception as error:
            await abort_for(error, context, self.runtime.stage)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stagediff serve vae", description=__doc__)
    add_stage_arguments(parser, default_port=50063)
    run_stage("vae", parser.parse_args(argv), VaeDecoderServicer)


if __name__ == "__main__":
    main()
