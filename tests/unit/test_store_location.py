"""`--store` and `--blobs` (services/orchestrator/store_location.py): what each accepts, and refusals that name
the flag and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.orchestrator.store_location import (
    LocalBlobsLocation,
    PostgresLocation,
    S3Location,
    blobs_location,
    store_location,
)


def test_a_postgresql_url_is_a_store() -> None:
    url = "postgresql://stagediff@db.internal:5432/jobs"
    assert store_location(url) == PostgresLocation(url)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("postgresql://user:secret@db/jobs", "PGPASSWORD"),
        ("postgresql:///jobs", "names its host"),
        ("mysql://db/jobs", "'mysql://db/jobs': use a postgresql:// URL"),
        ("state", "SQLite in --state-dir"),
    ],
)
def test_bad_stores_are_refused_naming_the_flag(value: str, words: str) -> None:
    with pytest.raises(ValueError, match="--store") as refused:
        store_location(value)
    assert words in str(refused.value)


def test_a_directory_or_an_s3_bucket_holds_the_blobs() -> None:
    assert blobs_location("state/blobs") == LocalBlobsLocation(Path("state/blobs"))
    found = blobs_location("s3://results/stagediff/prod", endpoint="http://127.0.0.1:8333")
    assert found == S3Location("results", "stagediff/prod/", "http://127.0.0.1:8333", "when_required")
    assert blobs_location("s3://results", checksums="when_supported").prefix == ""


@pytest.mark.parametrize(
    ("value", "options", "words"),
    [
        ("s3://Results", {}, "--blobs 's3://Results': the bucket is 3 to 63"),
        ("s3://ab", {}, "the bucket is 3 to 63"),
        ("s3://results/a b", {}, "--blobs 's3://results/a b': the prefix's blob key"),
        ("s3://results?endpoint=x", {}, "--blobs-endpoint"),
        ("s3://results", {"endpoint": "127.0.0.1:8333"}, "--blobs-endpoint '127.0.0.1:8333'"),
        ("s3://results", {"checksums": "always"}, "--blobs-checksums 'always'"),
        ("gs://results", {}, "'gs://...': use a directory or s3://BUCKET[/PREFIX]"),
        ("state/blobs", {"endpoint": "http://s3:8333"}, "only with --blobs s3://"),
    ],
)
def test_bad_blob_locations_are_refused_naming_the_flag(value: str, options: dict[str, str], words: str) -> None:
    with pytest.raises(ValueError) as refused:
        blobs_location(value, **options)
    assert words in str(refused.value)
