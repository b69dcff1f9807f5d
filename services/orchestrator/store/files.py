"""A job's files in the state directory: stage outputs, input images, and its result as frames or encoded.

Layout of `jobs_dir`, one folder per job:

    <job_id>/stage-<stage>.chunks                   what a finished stage of an unfinished job sent
    <job_id>/stage-input-images.<hex>.chunks        the input images of a job whose conditioning is not done
    <job_id>/.result-frames.npy.<hex>.partial       the result of a running job, written as it streams
    <job_id>/result-frames.npy                      the final frames, uint8 [F, H, W, 3]
    <job_id>/.result.<ext>.<hex>.partial            the encoded result of a running job, as encoded
    <job_id>/result.<ext>                           the encoded result (result.mp4, result.png...)
    <job_id>/.result-audio.npy.<hex>.partial        the sound of a running job's result, once the VAE sent it
    <job_id>/result-audio.npy                       the result's sound, float32 [channels, samples]

With a blob store (`blobs`, e.g. S3), stage outputs, input images and committed results are blobs under the
same names (`<job_id>/<file>`), and the jobs folder keeps only the spool of results being written, each
streamed to its blob as it grows (result_files.py). The names of what a claim writes then carry its lease
epoch (`e<epoch>/result-frames.npy`, `stage-dit.e<epoch>.chunks`), so a replica that lost the job can
never overwrite what the new owner's rows name.

Rules. A file is complete (written, fsynced, renamed into place, folder fsynced; or a blob committed) before
the store commits the row that names it, so a file no row names is a leftover that `sweep` removes. Files are named by
(job_id, file name) across this module's interface; it holds no database and never decides when a file is
kept or deleted (the store does). Stage outputs and input images are their protobuf messages, length-
prefixed, in order, as they came off the wire (never decoded here). Errors are StoreError with a one-line
message that names no server path (StoreFull when out of space); the result file formats are in
result_files.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
from google.protobuf import proto
from google.protobuf.message import DecodeError

from services.orchestrator import notices as job_notices
from services.orchestrator.blobs.protocol import BlobError, BlobStore
from services.orchestrator.result_files import (
    AUDIO_FILE,
    ENCODED_FILE,
    RESULT_FILE,
    AudioWriter,
    EncodedWriter,
    ResultWriter,
    StoredResult,
    check_shape,
    npy_header,
    read_npy_header,
)
from services.orchestrator.store.records import INPUT_IMAGES, SavedImages
from services.orchestrator.store_errors import StoreError, blob_error, fsync_dir, io_error
from stagediff.v1 import image_pb2, tensor_pb2

JOBS_DIR = "jobs"
_TMP_SUFFIX = ".tmp"
_PARTIAL_SUFFIX = ".partial"
_CHUNKS_SUFFIX = ".chunks"
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")


def check_name(kind: str, value: str) -> None:
    """Refuses a job id or stage name that is not a plain file name part."""
    if not _NAME.match(value):
        raise ValueError(f"{kind}: '{value}' must be 1-128 of A-Z a-z 0-9 _ - . and not start with '.'")


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


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Writes a file so that it is either absent or complete, also after a crash."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class JobFiles:
    """The folders of every job under `jobs_dir`, or their blobs in `blobs`. Blocking (fsync, large files,
    network): call through to_thread."""

    def __init__(self, jobs_dir: Path, blobs: BlobStore | None = None) -> None:
        self.jobs_dir = jobs_dir
        self.blobs = blobs
        self._deletes: ThreadPoolExecutor | None = None

    def _put(self, job_id: str, file: str, data: memoryview, what: str) -> None:
        """Stores a durable file whole: a blob, or a local file written atomically."""
        if self.blobs is None:
            try:
                atomic_write(self.job_dir(job_id, create=True) / file, lambda out: out.write(data))
            except FileNotFoundError:
                raise
            except OSError as error:
                raise io_error(error, f"job {job_id}: {what}") from None
            return
        try:
            self.blobs.put(f"{job_id}/{file}", bytes(data))
        except Exception as error:
            raise blob_error(error, f"job {job_id}: {what}") from None

    def _get(self, job_id: str, file: str) -> BinaryIO:
        """A durable file to read from start to end."""
        if self.blobs is None:
            return open(self.jobs_dir / job_id / file, "rb")
        try:
            return io.BytesIO(self.blobs.get(f"{job_id}/{file}"))
        except BlobError:
            raise  # a missing blob: the caller names what could not be read
        except Exception as error:
            raise blob_error(error, f"job {job_id}: reading {file}") from None

    def job_dir(self, job_id: str, *, create: bool = False) -> Path:
        check_name("job_id", job_id)
        directory = self.jobs_dir / job_id
        if create and not directory.is_dir():
            try:
                directory.mkdir(exist_ok=True)
                fsync_dir(self.jobs_dir)
            except OSError as error:
                raise io_error(error, f"job {job_id}: creating its folder") from None
        return directory

    def size_of(self, job_id: str, file: str) -> int:
        """A job file's size, 0 if it is not there."""
        path = self.jobs_dir / job_id / file
        return path.stat().st_size if path.is_file() else 0

    def unlink(self, job_id: str, files: Iterable[str]) -> None:
        """Deletes files no row names any more: at once in the state dir; in a blob store, in the background
        (off the path of the job whose commit dropped them), and what fails is the janitor's."""
        if self.blobs is None:
            for file in files:
                (self.jobs_dir / job_id / file).unlink(missing_ok=True)
            return
        blobs, keys = self.blobs, [f"{job_id}/{file}" for file in files]
        if keys:
            self._deleter().submit(_delete_quietly, blobs, keys)

    def _deleter(self) -> ThreadPoolExecutor:
        if self._deletes is None:
            self._deletes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blob-deletes")
        return self._deletes

    def close(self) -> None:
        """Waits for the background deletes."""
        if self._deletes is not None:
            self._deletes.shutdown(wait=True)
            self._deletes = None

    def remove_job(self, job_id: str) -> None:
        """Deletes the job's folder (its spool) and everything in it, and its blobs."""
        shutil.rmtree(self.jobs_dir / job_id, ignore_errors=True)
        if self.blobs is not None:
            with contextlib.suppress(Exception):
                self.blobs.delete_prefix(f"{job_id}/")

    # -------------------------------------------------------- input images --

    def save_input_images(self, job_id: str, images: Iterable[image_pb2.InputImage]) -> SavedImages | None:
        """Writes a new job's input images under a name no other job's can have; None without images."""
        check_name("job_id", job_id)
        buffer = io.BytesIO()
        for image in images:
            proto.serialize_length_prefixed(image, buffer)
        if not buffer.tell():
            return None
        data = buffer.getbuffer()
        file = f"stage-{INPUT_IMAGES}.{uuid.uuid4().hex}{_CHUNKS_SUFFIX}"  # never another job's, by any id
        self._put(job_id, file, data, "saving its input images")
        return SavedImages(file, len(data))

    def discard_input_images(self, job_id: str, images: SavedImages) -> None:
        """Deletes saved images, and the job's folder if nothing else is in it."""
        self.unlink(job_id, [images.file])
        with contextlib.suppress(OSError):
            (self.jobs_dir / job_id).rmdir()  # only when nothing else is there

    def load_input_images(self, job_id: str, file: str) -> list[image_pb2.InputImage]:
        images: list[image_pb2.InputImage] = []
        try:
            with self._get(job_id, file) as stream:
                while (image := proto.parse_length_prefixed(image_pb2.InputImage, _readable(stream))) is not None:
                    images.append(image)
        except (OSError, ValueError, DecodeError, BlobError) as error:
            raise StoreError(f"job {job_id}: its input images cannot be read: {error}") from None
        return images

    # ------------------------------------------------------- stage outputs --

    def save_stage(
        self, job_id: str, stage: str, chunks: Iterable[tensor_pb2.TensorChunk], epoch: int = 0
    ) -> tuple[str, int]:
        """Writes a finished stage's chunks, by the claim of lease `epoch`; returns the file's name and size.

        Raises FileNotFoundError if the job's folder was deleted while writing (the caller knows why).
        """
        buffer = io.BytesIO()
        for chunk in chunks:
            proto.serialize_length_prefixed(chunk, buffer)
        data = buffer.getbuffer()
        file = f"stage-{stage}{_CHUNKS_SUFFIX}" if self.blobs is None else f"stage-{stage}.e{epoch}{_CHUNKS_SUFFIX}"
        self._put(job_id, file, data, f"saving the output of stage {stage}")
        return file, len(data)

    def load_stage(self, job_id: str, stage: str, file: str) -> list[tensor_pb2.TensorChunk]:
        chunks: list[tensor_pb2.TensorChunk] = []
        try:
            with self._get(job_id, file) as stream:
                while (chunk := proto.parse_length_prefixed(tensor_pb2.TensorChunk, _readable(stream))) is not None:
                    chunks.append(chunk)
        except (OSError, ValueError, DecodeError, BlobError) as error:
            raise StoreError(f"job {job_id}: the saved output of stage {stage} cannot be read: {error}") from None
        return chunks

    # ------------------------------------------------------------- results --

    def create_result(self, job_id: str, shape: tuple[int, int, int, int], epoch: int = 0) -> ResultWriter:
        """Preallocates a result file of `shape` under a temporary name (streamed to its blob, with a blob
        store, under the claim of lease `epoch`)."""
        header = npy_header(shape)
        nbytes = len(header) + shape[0] * shape[1] * shape[2] * shape[3]
        try:
            directory = self.job_dir(job_id, create=True)
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
            directory = self.job_dir(job_id, create=True)
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
            directory = self.job_dir(job_id, create=True)
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

    # --------------------------------------------------------------- sweep --

    def sweep(self, known: set[str], referenced: set[tuple[str, str]]) -> None:
        """Removes what a crash can leave behind: temporary and partial files, folders of jobs not `known`, and
        files whose (job_id, file) is not `referenced`."""
        for directory in self.jobs_dir.iterdir():
            if not directory.is_dir() or directory.name not in known:
                if directory.is_dir():
                    shutil.rmtree(directory, ignore_errors=True)
                else:
                    directory.unlink(missing_ok=True)
                continue
            for path in directory.iterdir():
                if (directory.name, path.name) not in referenced:
                    if path.is_dir():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                directory.rmdir()  # only succeeds when nothing is left

    def collect_garbage(self, referenced: set[tuple[str, str]], written_before: float) -> int:
        """Deletes the blobs not `referenced` as (job_id, file) and written before the unix time `written_before`;
        returns how many."""
        assert self.blobs is not None
        deleted = 0
        for key, written_at in self.blobs.listing(""):
            job_id, _, name = key.partition("/")
            if (job_id, name) not in referenced and written_at < written_before:
                self.blobs.delete(key)
                deleted += 1
        return deleted


def _delete_quietly(blobs: BlobStore, keys: list[str]) -> None:
    for key in keys:
        with contextlib.suppress(Exception):  # the janitor deletes what is left
            blobs.delete(key)


def _readable(stream: BinaryIO) -> io.BytesIO:
    """`stream` as `proto.parse_length_prefixed` is typed (it reads any binary stream)."""
    return cast(io.BytesIO, stream)
