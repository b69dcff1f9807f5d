"""BlobStore on S3 (any S3-compatible store), through boto3; keys live under the store's `prefix`.

A writer buffers PART_BYTES (S3's least part but the last is 5 MiB) and uploads each full part of a multipart
upload as it fills; `commit` completes the upload, so the object appears whole or not at all, and `abort`
aborts it, leaving no part stored. A blob smaller than one part is one PutObject. boto3 adds CRC checksums to
every request by default since 1.36, which some S3-compatible stores refuse: `checksums="when_required"`
(the default here) sends them only where the API demands.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from services.orchestrator.blobs.protocol import BlobError, BlobNotFound, check_key, check_prefix, check_range

PART_BYTES = 8 << 20
CHECKSUM_MODES = ("when_required", "when_supported")


def s3_client(endpoint: str | None, access_key: str | None, secret_key: str | None, *, checksums: str) -> Any:
    """A boto3 S3 client; None values fall back to boto3's own configuration (environment, files, roles)."""
    import boto3
    from botocore.config import Config

    if checksums not in CHECKSUM_MODES:
        raise ValueError(f"checksums '{checksums}': use one of {', '.join(CHECKSUM_MODES)}")
    config = Config(
        request_checksum_calculation=checksums,
        response_checksum_validation=checksums,
        retries={"mode": "standard", "max_attempts": 3},
        signature_version="s3v4",  # presigned URLs too: SigV2 is deprecated, and refused by newer regions
        connect_timeout=5,
        read_timeout=60,
    )
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        config=config,
    )


def _is_missing(error: Exception) -> bool:
    code = getattr(error, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound")


class S3BlobWriter:
    """A multipart upload, started when the first part fills."""

    def __init__(self, blobs: S3Blobs, key: str) -> None:
        self.key = key
        self._blobs = blobs
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._size = 0
        self._open = True

    def write(self, data: bytes) -> None:
        if not self._open:
            raise BlobError(f"blob {self.key}: written after commit or abort")
        self._buffer += data
        self._size += len(data)
        while len(self._buffer) >= PART_BYTES:
            self._upload_part(bytes(self._buffer[:PART_BYTES]))
            del self._buffer[:PART_BYTES]

    def _upload_part(self, data: bytes) -> None:
        client, bucket, name = self._blobs.client, self._blobs.bucket, self._blobs.object_name(self.key)
        if self._upload_id is None:
            self._upload_id = client.create_multipart_upload(Bucket=bucket, Key=name)["UploadId"]
        number = len(self._parts) + 1
        answer = client.upload_part(Bucket=bucket, Key=name, UploadId=self._upload_id, PartNumber=number, Body=data)
        self._parts.append({"ETag": answer["ETag"], "PartNumber": number})

    def commit(self) -> int:
        if not self._open:
            raise BlobError(f"blob {self.key}: committed after commit or abort")
        self._open = False
        client, bucket, name = self._blobs.client, self._blobs.bucket, self._blobs.object_name(self.key)
        try:
            if self._upload_id is None:
                client.put_object(Bucket=bucket, Key=name, Body=bytes(self._buffer))
            else:
                if self._buffer:
                    self._upload_part(bytes(self._buffer))
                client.complete_multipart_upload(
                    Bucket=bucket, Key=name, UploadId=self._upload_id, MultipartUpload={"Parts": self._parts}
                )
        except Exception as error:
            self.abort()
            raise BlobError(f"blob {self.key}: {error}") from None
        self._buffer.clear()
        return self._size

    def abort(self) -> None:
        self._open = False
        self._buffer.clear()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self._blobs.client.abort_multipart_upload(
                Bucket=self._blobs.bucket, Key=self._blobs.object_name(self.key), UploadId=upload_id
            )


class S3Blobs:
    """Blobs as objects `<prefix><key>` of `bucket`."""

    def __init__(self, client: Any, bucket: str, prefix: str = "") -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = check_prefix(prefix) if prefix else ""

    def object_name(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.object_name(key), Body=data)

    def get(self, key: str) -> bytes:
        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=self.object_name(key))["Body"].read())
        except Exception as error:
            if _is_missing(error):
                raise BlobNotFound(key) from None
            raise

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_range(key, start, end, self.size(key))
        if start == end:
            return b""
        answer = self.client.get_object(Bucket=self.bucket, Key=self.object_name(key), Range=f"bytes={start}-{end - 1}")
        return bytes(answer["Body"].read())

    def size(self, key: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self.object_name(key))["ContentLength"])
        except Exception as error:
            if _is_missing(error):
                return None
            raise

    def writer(self, key: str) -> S3BlobWriter:
        check_key(key)
        return S3BlobWriter(self, key)

    def keys(self, prefix: str) -> Iterator[str]:
        for key, _ in self.listing(prefix):
            yield key

    def listing(self, prefix: str) -> Iterator[tuple[str, float]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + check_prefix(prefix)
        )
        for page in pages:
            for item in page.get("Contents", []):
                yield item["Key"][len(self.prefix) :], item["LastModified"].timestamp()

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.object_name(key))

    def delete_prefix(self, prefix: str) -> int:
        keys = list(self.keys(prefix))
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self.prefix + key} for key in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        return len(keys)

    def presigned_get(self, key: str, expires_s: int, *, media_type: str, filename: str) -> str:
        params = {
            "Bucket": self.bucket,
            "Key": self.object_name(key),
            "ResponseContentType": media_type,
            "ResponseContentDisposition": f'attachment; filename="{filename}"',
        }
        url: str = self.client.generate_presigned_url("get_object", Params=params, ExpiresIn=expires_s)
        return url

    def open_uploads(self, prefix: str = "") -> list[str]:
        """The keys of multipart uploads started and neither completed nor aborted (under `prefix`)."""
        answer = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix + prefix)
        return [upload["Key"][len(self.prefix) :] for upload in answer.get("Uploads", [])]
