"""A job's result files in the store: the spool of a running job's result, completed all or none, and the
committed files found again from their row.

A running job's result (frames, encoded file, sound) is written in its folder under temporary names
(`.<file>.<hex>.partial`, the layout is in files.py) by the writers of result_writers.py; with a blob store it
is streamed to its blob as it grows, under a name that carries the claim's lease epoch (`e<epoch>/<file>`), so
a replica that lost the job never overwrites what the new owner's rows name. `complete_result` fsyncs and
renames (or completes the uploads of) a result's files together, before the store commits the row that names
them; `uncommit_result` takes them back when that row cannot be committed. `stored_result` checks a committed
result's files against its row (sizes, the frames' shape) and describes them as a StoredResult.

Like files.py, this module holds no database and never decides when a file is kept or deleted (the store
does); errors are StoreError with a one-line message that names no server path.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from services.orchestrator import notices as job_notices
from services.orchestrator.blobs.protocol import BlobStore
from services.orchestrator.result_files import (
    AUDIO_FILE,
    ENCODED_FILE,
    RESULT_FILE,
    check_shape,
    npy_header,
    read_npy_header,
)
from services.orchestrator.result_writers import AudioWriter, EncodedWriter, ResultWriter
from services.orchestrator.store.files import JobFiles
from services.orchestrator.store_errors import StoreError, blob_error, io_error
from services.orchestrator.stored_result import StoredResult

_PARTIAL_SUFFIX = ".partial"


class ResultFiles:
    """The result files of every job, in the folders and the blob store of `files`. Blocking (fsync, large
    files, network): call through to_thread."""

    def __init__(self, files: JobFiles) -> None:
        self._files = files

    @property
    def jobs_dir(self) -> Path:
        return self._files.jobs_dir

    @property
    def blobs(self) -> BlobStore | None:
        return self._files.blobs

    def create_result(self, job_id: str, shape: tuple[int, int, int, int], epoch: int = 0) -> ResultWriter:
        """Preallocates a result file of `shape` under a temporary name (streamed to its blob, with a blob
        store, under the claim of lease `epoch`)."""
        header = npy_header(shape)
        nbytes = len(header) + shape[0] * shape[1] * shape[2] * shape[3]
        try:
            directory = self._files.job_dir(job_id, create=True)
            partial = directory / f".{RESULT_FILE}.{uuid.uuid4().hex}{_PARTIAL_SUFFIX}"
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise io_error(error, f"job {job_id}: creating its result file") from None
        try:
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, nbytes)
        except OSError as error:
            os.close(fd)
            partial.unlink(missing_ok=True)
            raise io_error(error, f"job {job_id}: creating its result file") from None
        writer = ResultWriter(job_id, directory, shape, fd, partial, len(header))
        if self.blobs is not None:
            self._attach(writer, f"e{epoch}/{RESULT_FILE}", header)
        return writer

    def create_audio(self, job_id: str, waveform: np.ndarray, sample_rate: int, epoch: int = 0) -> AudioWriter:
        """Writes a result's sound, float32 [channels, samples], under a temporary name (streamed to its blob, with
        a blob store, under the claim of lease `epoch`)."""
        if waveform.dtype != np.float32 or waveform.ndim != 2:
            raise ValueError(
                f"sound: float32 [channels, samples] expected, got {waveform.dtype} {list(waveform.shape)}"
            )
        shape = (int(waveform.shape[0]), int(waveform.shape[1]))
        header = npy_header(shape, np.float32)
        try:
            directory = self._files.job_dir(job_id, create=True)
            partial = directory / f".{AUDIO_FILE}.{uuid.uuid4().hex}{_PARTIAL_SUFFIX}"
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise io_error(error, f"job {job_id}: creating its sound file") from None
        writer = AudioWriter(job_id, directory, shape, sample_rate, fd, partial, len(header))
        if self.blobs is not None:
            self._attach(writer, f"e{epoch}/{AUDIO_FILE}", b"")
        try:
            writer.write_all(header, np.ascontiguousarray(waveform, "<f4").tobytes())
        except BaseException:
            writer.discard()
            raise
        return writer

    def _attach(self, writer: ResultWriter | EncodedWriter | AudioWriter, file: str, written: bytes) -> None:
        try:
            assert self.blobs is not None
            writer.attach_upload(self.blobs, f"{writer.job_id}/{file}", written)
        except Exception as error:
            writer.discard()
            raise blob_error(error, f"job {writer.job_id}: starting the upload of its {writer.kind}") from None

    def create_encoded(self, job_id: str, extension: str, media_type: str, epoch: int = 0) -> EncodedWriter:
        """Opens an empty encoded result file under a temporary name; `extension` such as ".mp4"."""
        if not re.fullmatch(r"\.[a-z0-9]{1,8}", extension):
            raise ValueError(f"extension: {extension!r} is not a file extension")
        try:
            directory = self._files.job_dir(job_id, create=True)
            partial = directory / f".{ENCODED_FILE}{extension}.{uuid.uuid4().hex}{_PARTIAL_SUFFIX}"
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise io_error(error, f"job {job_id}: creating its encoded result file") from None
        writer = EncodedWriter(job_id, directory, extension, media_type, fd, partial)
        if self.blobs is not None:
            self._attach(writer, f"e{epoch}/{ENCODED_FILE}{extension}", b"")
        return writer

    @staticmethod
    def result_name(writer: ResultWriter | EncodedWriter | AudioWriter) -> str:
        """The name the store's row gives a result file: its blob's key in the job, or its file name."""
        return writer.blob_key.split("/", 1)[1] if writer.blob_key is not None else writer.path.name

    def complete_result(
        self, writer: ResultWriter, encoded: EncodedWriter | None, audio: AudioWriter | None = None
    ) -> None:
        """Fsyncs a result's files (frames, encoded file, sound) and renames them into place, all or none.

        Raises FileNotFoundError if a file was deleted meanwhile (the caller knows why).
        """
        extras = [file for file in (encoded, audio) if file is not None]
        done: list[EncodedWriter | AudioWriter] = []
        try:
            try:
                for extra in extras:
                    if self.blobs is not None:
                        extra._finish_upload(extra.size if isinstance(extra, EncodedWriter) else extra.nbytes)
                    else:
                        extra._finish_file()
                    done.append(extra)
                if self.blobs is not None:
                    writer._finish_upload(writer.nbytes)
                else:
                    writer._finish_file()
            except BaseException:
                for extra in done:
                    extra._uncommit()  # the files are committed together or not at all
                raise
        except FileNotFoundError:
            raise
        except OSError as error:
            raise io_error(error, f"job {writer.job_id}: completing its result") from None

    def uncommit_result(
        self, writer: ResultWriter, encoded: EncodedWriter | None, audio: AudioWriter | None = None
    ) -> None:
        """Deletes a completed result's files again, when its row could not be committed."""
        writer._uncommit()
        for extra in (encoded, audio):
            if extra is not None:
                extra._uncommit()

    def check_raw_blob(self, job_id: str, file: str, shape: list[int]) -> tuple[str, tuple[int, int, int, int], int]:
        """(key, shape, data offset) of a committed result blob that must hold frames of `shape`."""
        assert self.blobs is not None
        key, checked = f"{job_id}/{file}", check_shape(tuple(shape))
        data_offset = len(npy_header(checked))
        self._check_blob_size(job_id, key, data_offset + int(np.prod(checked)), "result")
        return key, checked, data_offset

    def check_encoded_blob(self, job_id: str, file: str, size: int) -> str:
        """The key of a committed encoded result blob that must hold `size` bytes."""
        key = f"{job_id}/{file}"
        self._check_blob_size(job_id, key, size, "encoded result")
        return key

    def _check_blob_size(self, job_id: str, key: str, size: int, what: str) -> None:
        assert self.blobs is not None
        try:
            found = self.blobs.size(key)
        except Exception as error:
            raise blob_error(error, f"job {job_id}: its {what} cannot be read") from None
        if found is None:
            raise StoreError(f"job {job_id}: its {what} cannot be read: it is no longer in the blob store")
        if found != size:
            raise StoreError(
                f"job {job_id}: the {what} does not hold the frames its record describes"
                if what == "result"
                else f"job {job_id}: its {what} has {found} bytes, its record says {size}"
            )

    def check_raw(self, job_id: str, file: str, shape: list[int]) -> tuple[Path, tuple[int, ...], int]:
        """(path, shape, data offset) of a committed result file that must hold frames of `shape`."""
        path = self.jobs_dir / job_id / file
        try:
            with open(path, "rb") as stream:
                found, data_offset = read_npy_header(stream)
                size = os.fstat(stream.fileno()).st_size
        except (OSError, ValueError) as error:
            raise StoreError(f"job {job_id}: its result file cannot be read: {error}") from None
        if list(found) != shape or size != data_offset + int(np.prod(found)):
            raise StoreError(f"job {job_id}: the result file does not hold the frames its record describes")
        return path, found, data_offset

    def check_audio(self, job_id: str, file: str, shape: list[int]) -> tuple[Path | None, str | None, int]:
        """(path or blob key, data offset) of a committed sound file that must hold float32 [channels, samples]."""
        if len(shape) != 2 or min(shape, default=0) < 1:
            raise StoreError(f"job {job_id}: its record gives its sound the shape {shape}")
        data_offset = len(npy_header(tuple(shape), np.float32))
        size = data_offset + shape[0] * shape[1] * 4
        if self.blobs is not None:
            key = f"{job_id}/{file}"
            self._check_blob_size(job_id, key, size, "sound")
            return None, key, data_offset
        path = self.jobs_dir / job_id / file
        try:
            found = path.stat().st_size
        except OSError as error:
            raise StoreError(f"job {job_id}: its sound cannot be read: {error}") from None
        if found != size:
            raise StoreError(f"job {job_id}: its sound has {found} bytes, its record says {size}")
        return path, None, data_offset

    def check_encoded(self, job_id: str, file: str, size: int) -> Path:
        """The path of a committed encoded result that must hold `size` bytes."""
        path = self.jobs_dir / job_id / file
        try:
            found = path.stat().st_size
        except OSError as error:
            raise StoreError(f"job {job_id}: its encoded result cannot be read: {error}") from None
        if found != size:
            raise StoreError(f"job {job_id}: its encoded result has {found} bytes, its record says {size}")
        return path

    def stored_result(self, job_id: str, row: Any) -> StoredResult:
        """The result a `results` row (joined with its job's timings and passes) describes, its files checked."""
        path: Path | None = None
        encoded_path: Path | None = None
        raw_key: str | None = None
        encoded_key: str | None = None
        shape: tuple[int, ...] = check_shape(json.loads(row["shape"]))
        data_offset = 0
        if self.blobs is None:
            if row["raw_kept"]:
                path, shape, data_offset = self.check_raw(job_id, row["file"], json.loads(row["shape"]))
            if row["encoded_file"]:
                encoded_path = self.check_encoded(job_id, row["encoded_file"], row["encoded_bytes"])
        else:
            if row["raw_kept"]:
                raw_key, shape, data_offset = self.check_raw_blob(job_id, row["file"], json.loads(row["shape"]))
            if row["encoded_file"]:
                encoded_key = self.check_encoded_blob(job_id, row["encoded_file"], row["encoded_bytes"])
        audio_path: Path | None = None
        audio_key: str | None = None
        audio_shape: list[int] = json.loads(row["audio_shape"] or "[]")
        audio_offset = 0
        if row["audio_file"]:
            audio_path, audio_key, audio_offset = self.check_audio(job_id, row["audio_file"], audio_shape)
        return StoredResult(
            audio_path=audio_path,
            audio_key=audio_key,
            audio_shape=(audio_shape[0], audio_shape[1]) if row["audio_file"] else (0, 0),
            audio_rate=row["audio_rate"],
            audio_offset=audio_offset,
            path=path,
            blobs=self.blobs,
            raw_key=raw_key,
            encoded_key=encoded_key,
            media_type=row["media_type"],
            encoded_path=encoded_path,
            encoded_bytes=row["encoded_bytes"],
            shape=check_shape(shape),
            data_offset=data_offset,
            fps=row["fps"],
            pieces=[(first, count) for first, count in json.loads(row["pieces"])],
            timings=json.loads(row["timings"]),
            transformer_passes=(row["passes_run"], row["passes_skipped"]),
            notices=job_notices.from_json(row["notices"]),
        )
