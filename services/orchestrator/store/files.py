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
streamed to its blob as it grows (result_writers.py). The names of what a claim writes then carry its lease
epoch (`e<epoch>/result-frames.npy`, `stage-dit.e<epoch>.chunks`), so a replica that lost the job can
never overwrite what the new owner's rows name.

Rules. A file is complete (written, fsynced, renamed into place, folder fsynced; or a blob committed) before
the store commits the row that names it, so a file no row names is a leftover that `sweep` removes. Files are named by
(job_id, file name) across this module's interface; it holds no database and never decides when a file is
kept or deleted (the store does). Stage outputs and input images are their protobuf messages, length-
prefixed, in order, as they came off the wire (never decoded here). Errors are StoreError with a one-line
message that names no server path (StoreFull when out of space).

This module holds what every job file shares (names, atomic writes, blobs put and read whole, deletes, the
sweep of leftovers), input images and stage outputs; a job's result files (the spool of a running job's
result, its completion, the committed files found again) are results.py's, and the result file formats
services/orchestrator/result_files.py's.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, cast

from google.protobuf import proto
from google.protobuf.message import DecodeError

from services.orchestrator.blobs.protocol import BlobError, BlobStore
from services.orchestrator.store.records import INPUT_IMAGES, SavedImages
from services.orchestrator.store_errors import StoreError, blob_error, fsync_dir, io_error
from stagediff.v1 import image_pb2, tensor_pb2

JOBS_DIR = "jobs"
_TMP_SUFFIX = ".tmp"
_CHUNKS_SUFFIX = ".chunks"
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")


def check_name(kind: str, value: str) -> None:
    """Refuses a job id or stage name that is not a plain file name part."""
    if not _NAME.match(value):
        raise ValueError(f"{kind}: '{value}' must be 1-128 of A-Z a-z 0-9 _ - . and not start with '.'")


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
