"""The durable job store: round trips, state rules, streamed results, retention per tenant, space, crash
leftovers, unusable state dirs, and a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from services.orchestrator.store import (
    RESULT_FILE,
    JobStore,
)
from stagediff.tensor_codec import encode_tensor
from tests.helpers.store import QUEUED, RUNNING, SUCCEEDED, files

REPO = Path(__file__).resolve().parents[2]


def test_the_orchestrator_exits_with_one_line_on_an_unusable_state_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    endpoints = [f"--{stage}=127.0.0.1:1" for stage in ("text-encoder", "dit", "vae", "interp")]
    run = subprocess.run(
        [sys.executable, "-m", "services.orchestrator.service", *endpoints, "--host", "127.0.0.1", "--insecure"]
        + ["--metrics-port", "0", "--state-dir", str(blocker / "state")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"stagediff serve orchestrator: --state-dir {blocker / 'state'}: cannot be used"), run.stderr
    assert "Traceback" not in run.stderr


_WRITER = """
import sys

import stagediff  # noqa: F401  (imports the generated modules in a working order)
import numpy as np

from services.orchestrator.store import JobRecord, JobState, JobStore
from stagediff.tensor_codec import encode_tensor
from stagediff.v1 import generation_pb2

store = JobStore.open(sys.argv[1])
for i in range(1000):
    job_id = f"job{i:04d}"
    request = generation_pb2.GenerateRequest(prompt=f"prompt {i}", seed=i, request_id=f"req{i}")
    store.insert(JobRecord.new(job_id, f"tenant{i % 3}", request))
    print("inserted", i, flush=True)
    store.update_state(job_id, JobState.JOB_STATE_RUNNING)
    store.mark_stage_done(job_id, "text-encoder", encode_tensor("prompt_embeds", np.full((1, 64), float(i))))
    print("stage", i, flush=True)
    frames = np.full((24, 256, 256, 3), i % 251, np.uint8)
    print("saving", i, flush=True)
    store.save_result(job_id, frames, 16.0, pieces=[(0, 1), (1, 23)], timings={"total": float(i)})
    print("saved", i, flush=True)
"""


def test_sigkill_loses_no_committed_record_and_no_half_result(tmp_path: Path) -> None:
    """The writer is killed while it writes a result file (or just after, if the write is quicker)."""
    state_dir = tmp_path / "state"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(state_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    seen: dict[str, set[int]] = {"inserted": set(), "stage": set(), "saving": set(), "saved": set()}
    assert writer.stdout is not None
    for line in writer.stdout:
        what, i = line.split()
        seen[what].add(int(i))
        if what == "saving" and int(i) == 4:
            # Kill as soon as the result file is being written (or, if that was missed, written).
            job_dir = state_dir / "jobs" / "job0004"
            while writer.poll() is None and not any(
                name.startswith((".", RESULT_FILE)) for name in os.listdir(job_dir)
            ):
                pass
            writer.send_signal(signal.SIGKILL)
            break
    seen_rest = writer.stdout.read()  # lines written before the signal landed
    writer.wait(timeout=60)
    assert writer.returncode == -signal.SIGKILL
    for line in seen_rest.splitlines():
        what, i = line.split()
        seen[what].add(int(i))

    with JobStore.open(state_dir) as store:
        records = {record.job_id: record for record in store.list_jobs(limit=10_000)}
        # Every insert the writer saw committed is there, intact.
        for i in seen["inserted"]:
            record = records[f"job{i:04d}"]
            assert record.tenant == f"tenant{i % 3}" and record.request_id == f"req{i}"
            request = record.parse_request()
            assert (request.prompt, request.seed) == (f"prompt {i}", i)
        for i in seen["stage"]:
            record = records[f"job{i:04d}"]
            if record.state != SUCCEEDED:
                chunks = store.load_intermediates(record.job_id)["text-encoder"]
                assert chunks == list(encode_tensor("prompt_embeds", np.full((1, 64), float(i))))
        assert {int(job_id[3:]) for job_id, r in records.items() if r.state == SUCCEEDED} >= seen["saved"]
        # A job has a result exactly when it succeeded, and every result is whole.
        for job_id, record in records.items():
            result = store.load_result(job_id)
            if record.state != SUCCEEDED:
                assert result is None and record.state in (QUEUED, RUNNING)
                continue
            i = int(job_id[3:])
            assert result.frames.shape == (24, 256, 256, 3) and np.all(result.frames == i % 251)
            assert result.pieces == [(0, 1), (1, 23)] and result.timings == {"total": float(i)}
        assert [r.job_id for r in store.recoverable()] == sorted(
            job_id for job_id, r in records.items() if r.state != SUCCEEDED
        )
        assert not [name for name in files(store) if name.endswith(".tmp")]
