"""A fake DiT behind the real `services.server.serve`, in a process of its own so that SIGTERM drains it as it
drains a stage: each call reports its step, holds for HOLD_S seconds, then sends its latents.

    python -m tests.helpers.draining_dit PORT DRAIN_GRACE_S HOLD_S
"""

from __future__ import annotations

import asyncio
import logging
import sys

import grpc

from services.server import serve
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from tests.helpers.fake_stages import LIMITS, MODEL, FakeControl, FakeDenoiser


class HoldingDenoiser(FakeDenoiser):
    """The fake DiT, holding each call for `hold_s` between its step and its latents."""

    def __init__(self, hold_s: float) -> None:
        super().__init__()
        self.hold_s = hold_s

    async def Denoise(self, request_iterator, context):
        async for response in super().Denoise(request_iterator, context):
            yield response
            if response.HasField("progress"):
                await asyncio.sleep(self.hold_s)


def main() -> None:
    port, grace, hold_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # "dit draining (grace ...)"
    info = stages_pb2.StageInfo(stage="dit", model=MODEL, family="wan-t2v", limits=LIMITS)

    def register(server: grpc.aio.Server) -> list[str]:
        stages_pb2_grpc.add_StageControlServicer_to_server(FakeControl(info), server)
        stages_pb2_grpc.add_DenoiserServicer_to_server(HoldingDenoiser(hold_s), server)
        return [stages_pb2.DESCRIPTOR.services_by_name[name].full_name for name in ("StageControl", "Denoiser")]

    asyncio.run(serve(name="dit", host="127.0.0.1", port=port, register=register, grace=grace))


if __name__ == "__main__":
    main()
