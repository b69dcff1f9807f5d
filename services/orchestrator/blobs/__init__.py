"""Where a job's files live: a local directory (the embedded default) or S3; see protocol.py for the rules."""

from services.orchestrator.blobs.local import LocalBlobs
from services.orchestrator.blobs.protocol import BlobError, BlobNotFound, BlobStore, BlobWriter, check_key
from services.orchestrator.blobs.s3 import S3Blobs, s3_client

__all__ = ["BlobError", "BlobNotFound", "BlobStore", "BlobWriter", "LocalBlobs", "S3Blobs", "check_key", "s3_client"]
