"""Result frames stream to the store as they are published; memory holds no frames, per job or per reader.

The orchestrator's real JobManager and Pipeline run here with the stage calls replaced (`FramePipeline`):
each job "decodes" frames computed from its request and publishes them as the VAE does (one frame, then
four per latent frame), through the real ResultPublisher into the real result file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# 16 watchers replay one stored 500-frame result at once. The pure-Python protobuf runtime keeps message bytes
# as Python objects, so tracemalloc sees every frame a reader holds (the upb runtime's arenas it would not).
_REPLAY = """
import asyncio
import json
import sys
import tracemalloc

import stagediff  # noqa: F401  (imports the generated modules in a working order)
import numpy as np

from services.orchestrator.jobs import JobManager
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.store import JobRecord, JobState, JobStore
from stagediff.v1 import generation_pb2

READERS, FRAMES, HEIGHT, WIDTH = 16, 500, 192, 256
store = JobStore.open(sys.argv[1])
request = generation_pb2.GenerateRequest(height=HEIGHT, width=WIDTH, num_frames=FRAMES)
store.insert(JobRecord.new("replayed", "acme", request))
store.update_state("replayed", JobState.JOB_STATE_RUNNING)
frames = np.zeros((FRAMES, HEIGHT, WIDTH, 3), np.uint8)
frames[:, 0, 0, 0] = np.arange(FRAMES) % 256
pieces = [(0, 1)] + [(first, min(4, FRAMES - first)) for first in range(1, FRAMES, 4)]
store.save_result("replayed", frames, 16.0, pieces=pieces)
video_bytes = frames.nbytes
del frames


async def run_job(job):
    raise AssertionError("nothing runs here")


async def replay(jobs):
    job = await jobs.get("replayed", "acme")
    received = 0
    async for event in job.follow():
        if event.HasField("result"):
            received += len(event.result.tensor.data)
    return received


async def main():
    jobs = JobManager(run_job, FairScheduler(), store)
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    received = await asyncio.gather(*(replay(jobs) for _ in range(READERS)))
    peak = tracemalloc.get_traced_memory()[1] - baseline
    print(json.dumps({"peak": peak, "received": received, "video_bytes": video_bytes}))


asyncio.run(main())
store.close()
"""


def test_sixteen_watchers_of_a_stored_result_hold_a_chunk_each_not_the_video(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _REPLAY, str(tmp_path / "state")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    measured = json.loads(run.stdout.splitlines()[-1])
    video = measured["video_bytes"]
    assert measured["received"] == [video] * 16
    # Each reader holds about one 1 MiB chunk (read, then in its message) at a time: the bound is tied to the
    # chunk size and the readers, and it is below one copy of the 74 MB video, let alone sixteen.
    bound = 16 * 3 * (1 << 20)
    assert bound < video
    assert measured["peak"] < bound, f"peak {measured['peak']} bytes traced, for 16 readers of {video} bytes"
