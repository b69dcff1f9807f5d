"""gRPC servicer of the frame-interpolation stage."""

from __future__ import annotations

import argparse

import grpc

from interp_svc.interpolate import StreamingInterpolator
from services.stage import RequestError, StageRuntime, abort_for
from services.stage_main import StageServicer, add_stage_arguments, run_stage
from services.tensor_codec import TensorAssembler, WireError, encode_tensor, expect_tensor
from stagediff.v1 import stages_pb2, stages_pb2_grpc

MAX_EXP = 4


class InterpolatorServicer(stages_pb2_grpc.InterpolatorServicer, StageServicer):
    service_name = stages_pb2.DESCRIPTOR.services_by_name["Interpolator"].full_name

    def __init__(self, args: argparse.Namespace, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.loaded = False

    def add_to_server(self, server: grpc.aio.Server) -> None:
        stages_pb2_grpc.add_InterpolatorServicer_to_server(self, server)

    def load(self) -> None:
        # The optical-flow interpolator has no weights to load.
        self.runtime.parallel_config = {"method": "optical-flow (OpenCV DIS), occlusion-aware blend"}
        self.loaded = True

    def _check_params(self, params: stages_pb2.InterpolateParams) -> None:
        if not 0 <= params.exp <= MAX_EXP:
            raise RequestError(f"exp: {params.exp} is not allowed; use 0 (pass through) to {MAX_EXP}")
        if not 0.0 <= params.scale <= 1.0:
            raise RequestError(f"scale: {params.scale} is not allowed; use a value in (0, 1], or 0 for 1.0")

    async def Interpolate(self, request_iterator, context):
        if not self.loaded:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "interp: still starting")
        spec = self.runtime.spec
        try:
            interpolator: StreamingInterpolator | None = None
            assembler = TensorAssembler()
            frame_shape: tuple[int, ...] | None = None
            async for request in request_iterator:
                if request.HasField("params"):
                    if interpolator is not None:
                        raise RequestError("params: sent twice; send params once, first")
                    self._check_params(request.params)
                    interpolator = StreamingInterpolator(request.params.exp)
                    continue
                if not request.HasField("tensor"):
                    raise RequestError("part: each message must set params or tensor")
                if interpolator is None:
                    raise RequestError("params: must be the first message, before any tensor")
                tensor = assembler.feed(request.tensor)
                if tensor is None:
                    continue
                expect_tensor(tensor, name="frames", datatypes=("UINT8",), ndim=4)
                count, height, width, channels = tensor.shape
                if count < 1 or channels != 3 or not (1 <= height <= spec.max_height and 1 <= width <= spec.max_width):
                    raise WireError(
                        f"tensor 'frames': shape {list(tensor.shape)} is not allowed; expected [n >= 1, H, W, 3] "
                        f"with H <= {spec.max_height} and W <= {spec.max_width}"
                    )
                if frame_shape is not None and tensor.shape[1:] != frame_shape:
                    raise WireError(
                        f"tensor 'frames': frames of {list(tensor.shape[1:])} follow frames of {list(frame_shape)}"
                    )
                frame_shape = tensor.shape[1:]
                first_out = interpolator.frames_out
                frames = await self.runtime.run(interpolator.push, tensor.array)
                if len(frames):
                    for chunk in encode_tensor("frames", frames, index=first_out):
                        yield stages_pb2.InterpolateResponse(tensor=chunk)
            assembler.finish()
            if interpolator is None:
                raise RequestError("params: missing; the first message must carry InterpolateParams")
        except Exception as error:
            await abort_for(error, context, self.runtime.stage)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stagediff serve interp", description=__doc__)
    add_stage_arguments(parser, default_port=50064)
    run_stage("interp", parser.parse_args(argv), InterpolatorServicer)


if __name__ == "__main__":
    main()
