"""`JobResults`, the part of `JobStore` that handles a running job's result: its files made (frames,
encoded file, sound), then completed and committed with the job's SUCCEEDED row in one step; and a
succeeded job's result loaded back.

`JobStore` (jobstore.py) is made of it, and its guarantees hold here: a result's files are complete
(results.py: fsynced and renamed into place, or their uploads completed) before the row that names them is
committed (rows.py), and are taken back if that row cannot be committed; the files the commit drops (the
job's intermediates, the raw frames an encoded result does not keep) are deleted only after its transaction.
Every write names this store's claim of the job, and changes nothing once another replica claimed it again
(LeaseLost). Blocking: call through `asyncio.to_thread`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from services.orchestrator.result_files import check_shape
from services.orchestrator.result_writers import AudioWriter, EncodedWriter, ResultWriter
from services.orchestrator.store.files import JobFiles
from services.orchestrator.store.leases import HeldClaims
from services.orchestrator.store.records import JobRecord, JobState
from services.orchestrator.store.results import ResultFiles
from services.orchestrator.store.rows import JobRows
from services.orchestrator.store_errors import InvalidTransition, StoreError
from services.orchestrator.stored_result import StoredResult

RUNNING = (JobState.JOB_STATE_RUNNING,)


def check_frames(frames: np.ndarray) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"frames: uint8 [F, H, W, 3] expected, got {frames.dtype} {list(frames.shape)}")


def check_pieces(pieces: list[tuple[int, int]], num_frames: int) -> None:
    """Refuses pieces (first frame, count) that do not cover the frames exactly once."""
    covered = sorted(pieces)
    expected = 0
    for first, count in covered:
        if first != expected or count < 1:
            raise ValueError(f"pieces {covered} must cover frames 0..{num_frames - 1} without gaps or overlaps")
        expected = first + count
    if expected != num_frames:
        raise ValueError(f"pieces {covered} must cover frames 0..{num_frames - 1} without gaps or overlaps")


class JobResults:
    """A job's result operations of `JobStore`, over the parts it is made of (declared here, set by JobStore)."""

    clock: Callable[[], float]
    files: JobFiles
    result_files: ResultFiles
    _rows: JobRows
    _claims: HeldClaims

    def create_result(self, job_id: str, shape: tuple[int, ...]) -> ResultWriter:
        """Preallocates a running job's result file of `shape` [F, H, W, 3]; blocking, use to_thread.

        Raises InvalidTransition if the job is not running, StoreError (StoreFull) if the file cannot be made.
        """
        checked = check_shape(shape)
        self._require_running(job_id)
        return self.result_files.create_result(job_id, checked, self._claims.epoch(job_id))

    def create_encoded(self, job_id: str, extension: str, media_type: str) -> EncodedWriter:
        """Opens a running job's encoded result file (empty, appended to); blocking, use to_thread."""
        self._require_running(job_id)
        return self.result_files.create_encoded(job_id, extension, media_type, self._claims.epoch(job_id))

    def create_audio(self, job_id: str, waveform: np.ndarray, sample_rate: int) -> AudioWriter:
        """Writes a running job's sound, float32 [channels, samples], whole (committed with its result by
        `commit_result`); blocking, use to_thread."""
        self._require_running(job_id)
        return self.result_files.create_audio(job_id, waveform, sample_rate, self._claims.epoch(job_id))

    def _require_running(self, job_id: str) -> None:
        """InvalidTransition unless the job runs (LeaseLost if this store's claim of it was lost)."""
        self._rows.require_state(job_id, RUNNING, self._claims.fence(job_id))

    def commit_result(
        self,
        writer: ResultWriter,
        fps: float,
        *,
        encoded: EncodedWriter | None = None,
        audio: AudioWriter | None = None,
        keep_raw: bool = True,
        timings: Mapping[str, float] | None = None,
        passes: tuple[int, int] | None = None,
        at: float | None = None,
    ) -> JobRecord:
        """Completes a written result and marks its job SUCCEEDED in one step, with the DiT's (run, skipped)
        transformer `passes`; blocking, use to_thread.

        The writer's pieces must cover every frame (ValueError otherwise). With `encoded`, its file is completed
        too, and the raw frames are deleted once committed unless `keep_raw`. With `audio` (the result's sound),
        its file is kept beside the raw frames, and deleted with them (the encoded file has the sound muxed in).
        Raises InvalidTransition (keeping nothing) if the job is not running, e.g. it was cancelled meanwhile.
        """
        job_id = writer.job_id
        check_pieces(writer.pieces, writer.shape[0])
        keep_raw = keep_raw or encoded is None
        fence = self._claims.fence(job_id)
        self._require_running(job_id)
        try:
            self.result_files.complete_result(writer, encoded, audio)
        except FileNotFoundError:
            if self._rows.finished_or_gone(job_id):  # cancelled and deleted while writing
                raise InvalidTransition(f"job {job_id} finished or was deleted while its result was written") from None
            raise StoreError(f"job {job_id}: its result file disappeared before it was complete") from None
        at = self.clock() if at is None else at
        try:
            record, files = self._rows.commit_result(
                job_id,
                fence=fence,
                file=self.result_files.result_name(writer),
                shape=writer.shape,
                fps=fps,
                pieces=writer.pieces,
                at=at,
                nbytes=(writer.nbytes + (audio.nbytes if audio is not None else 0) if keep_raw else 0)
                + (encoded.size if encoded is not None else 0),
                media_type=encoded.media_type if encoded is not None else "",
                encoded_file=self.result_files.result_name(encoded) if encoded is not None else None,
                encoded_bytes=encoded.size if encoded is not None else 0,
                raw_kept=keep_raw,
                timings=timings,
                passes=passes,
                audio=(self.result_files.result_name(audio), audio.shape, audio.sample_rate)
                if audio is not None and keep_raw
                else None,
            )
        except BaseException:
            self.result_files.uncommit_result(writer, encoded, audio)
            raise
        self._claims.forget(job_id)
        if not keep_raw:
            files.append(self.result_files.result_name(writer))
            if audio is not None:
                files.append(self.result_files.result_name(audio))
        self.files.unlink(job_id, files)
        return record

    def save_result(
        self,
        job_id: str,
        frames: np.ndarray,
        fps: float,
        *,
        pieces: list[tuple[int, int]] | None = None,
        timings: Mapping[str, float] | None = None,
        at: float | None = None,
    ) -> JobRecord:
        """Stores frames the caller already holds whole and marks the job SUCCEEDED; blocking, use to_thread.

        `create_result` + `ResultWriter.write` + `commit_result` in one call.
        `pieces` are the (first frame, count) of the tensors as first published;
        the default is one piece.
        """
        check_frames(frames)
        pieces = [(int(first), int(count)) for first, count in (pieces or [(0, frames.shape[0])])]
        check_pieces(pieces, frames.shape[0])
        writer = self.create_result(job_id, frames.shape)
        try:
            writer.write(0, 0, np.ascontiguousarray(frames).reshape(-1).data)
            for first, count in pieces:
                writer.add_piece(first, count)
            return self.commit_result(writer, fps, timings=timings, at=at)
        finally:
            writer.discard()

    def load_result(self, job_id: str) -> StoredResult | None:
        """A succeeded job's result (file, shape, pieces), None if it has none; reads the file's header only."""
        row = self._rows.result(job_id)
        return None if row is None else self.result_files.stored_result(job_id, row)
