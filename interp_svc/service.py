"""gRPC servicer of the frame-interpolation stage."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import grpc

from interp_svc.config import InterpConfig
from interp_svc.interpolate import StreamingInterpolator
from interp_svc.options import build_parser
from interp_svc.rife import SUPPORTED_SCALES, IFNet, StreamingRifeInterpolator, load_rife
from services.checkpoint import CheckpointSpec
from services.environment_options import parse_args
from services.model_source import stage_model
from services.stage import RequestError, StageRuntime, abort_for, parameter_bytes
from services.stage_main import StageServicer, run_stage
from services.torch_wire import encode_tensor
from stagediff.tensor_codec import TensorAssembler, WireError, expect_tensor
from stagediff.v1 import stages_pb2, stages_pb2_grpc

MAX_EXP = 4


class InterpolatorServicer(stages_pb2_grpc.InterpolatorServicer, StageServicer):
    service_name = stages_pb2.DESCRIPTOR.services_by_name["Interpolator"].full_name

    def __init__(self, model_path: str, runtime: StageRuntime) -> None:
        """`model_path`: the RIFE weights served (InterpConfig.model_path); empty: optical flow."""
        self.runtime = runtime
        self.model_path = model_path
        # The largest frames taken: the checkpoint's limits, or without --model those every checkpoint has.
        bounds = runtime.spec if runtime.spec is not None else CheckpointSpec
        self.max_height, self.max_width = bounds.max_height, bounds.max_width
        self.rife: IFNet | None = None
        self.loaded = False

    def add_to_server(self, server: grpc.aio.Server) -> None:
        stages_pb2_grpc.add_InterpolatorServicer_to_server(self, server)

    def load(self) -> None:
        if self.model_path:
            self.rife = load_rife(self.model_path, self.runtime.device, dtype=self.runtime.dtype)
            self.runtime.parameter_bytes = {"rife": parameter_bytes(self.rife)}
            self.runtime.parallel_config = {"method": f"RIFE IFNet ({self.model_path})"}
            self.runtime.weights_path = self.model_path
        else:
            # The optical-flow interpolator has no weights to load.
            self.runtime.parallel_config = {"method": "optical flow both ways (OpenCV DIS), occlusion-aware blend"}
        self.loaded = True

    def _interpolator(self, params: stages_pb2.InterpolateParams) -> StreamingInterpolator:
        if self.rife is None:
            return StreamingInterpolator(params.exp)
        return StreamingRifeInterpolator(params.exp, self.rife, params.scale or 1.0)

    def _check_params(self, params: stages_pb2.InterpolateParams) -> None:
        if not 0 <= params.exp <= MAX_EXP:
            raise RequestError(f"exp: {params.exp} is not allowed; use 0 (pass through) to {MAX_EXP}")
        if params.scale and params.scale not in SUPPORTED_SCALES:
            raise RequestError(f"scale: {params.scale} is not allowed; use one of {list(SUPPORTED_SCALES)}, or 0 for 1")
        if params.model_path and params.model_path != (self.model_path or ""):
            served = f"'{self.model_path}'" if self.model_path else "no learned model (optical flow)"
            raise RequestError(
                f"model_path: '{params.model_path}' is not served here; this interpolator serves {served} "
                "(set with --interp-model-path)"
            )

    async def Interpolate(
        self,
        request_iterator: AsyncIterator[stages_pb2.InterpolateRequest],
        context: grpc.aio.ServicerContext[stages_pb2.InterpolateRequest, stages_pb2.InterpolateResponse],
    ) -> AsyncIterator[stages_pb2.InterpolateResponse]:
        if not self.loaded:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "interp: still starting")
        try:
            interpolator: StreamingInterpolator | None = None
            assembler = TensorAssembler()
            frame_shape: tuple[int, ...] | None = None
            async for request in request_iterator:
                if request.HasField("params"):
                    if interpolator is not None:
                        raise RequestError("params: sent twice; send params once, first")
                    self._check_params(request.params)
                    interpolator = self._interpolator(request.params)
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
                if count < 1 or channels != 3 or not (1 <= height <= self.max_height and 1 <= width <= self.max_width):
                    raise WireError(
                        f"tensor 'frames': shape {list(tensor.shape)} is not allowed; expected [n >= 1, H, W, 3] "
                        f"with H <= {self.max_height} and W <= {self.max_width}"
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
    args = parse_args(build_parser(), argv)
    args.model = stage_model("interp", args.model)
    config = InterpConfig.from_args(args)
    run_stage(config.stage, functools.partial(InterpolatorServicer, config.model_path))


if __name__ == "__main__":
    main()
