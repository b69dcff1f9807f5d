"""The job store's own tests, run again on the other backends: rows in PostgreSQL and blobs in S3, each on a
real server started once for the session (tests/conftest.py).

The tests are those of tests/unit/test_store.py and tests/unit/test_retention.py that hold for every
backend (the rest read SQLite files or pragmas themselves); this module collects them once more with its own
`open_store`: the other implementation of each protocol, rows in PostgreSQL with blobs in S3 (the unit tier runs
SQLite with the state directory; the code of the two protocols is independent, so these two combinations cover
each implementation).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.orchestrator.blobs import S3Blobs, s3_client
from services.orchestrator.store import JobStore
from stagediff.local.servers import Postgres, S3Server
from tests.unit.test_retention import (  # noqa: F401 - collected here with this module's open_store
    test_a_store_error_at_dispatch_fails_that_job_and_the_queue_moves_on,
    test_new_jobs_are_refused_while_the_state_volume_is_nearly_full,
    test_one_tenant_finishing_many_jobs_never_deletes_another_tenants,
    test_stored_bytes_are_a_tenant_quota,
)
from tests.unit.test_store import (  # noqa: F401 - collected here with this module's open_store
    clock,
    store,
    test_a_changed_result_file_is_an_error_not_a_replay,
    test_a_discarded_or_crashed_result_leaves_nothing,
    test_a_result_streams_into_its_file_and_is_read_back_while_written,
    test_an_unreadable_saved_output_is_a_store_error_naming_the_stage,
    test_bad_results_are_refused,
    test_calls_from_several_threads,
    test_finishing_a_job_drops_its_intermediates,
    test_intermediates_round_trip_as_the_chunks_the_stages_sent,
    test_listing_filters_and_pages,
    test_prune_and_delete,
    test_prune_keeps_each_tenant_within_its_own_limits,
    test_record_round_trip,
    test_recoverable_lists_unfinished_jobs_in_admission_order,
    test_request_ids_are_unique_per_tenant,
    test_result_round_trip_and_replay,
    test_served_models_are_kept_until_no_dit_reports_them_for_a_week,
    test_state_transitions,
)


@pytest.fixture(params=["postgres+s3"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., JobStore]:
    """Opens stores of one backend combination; every store a test opens shares its database and bucket prefix
    (a reopened store finds what the last one stored)."""
    rows, blobs = request.param.split("+")
    options: dict[str, Any] = {}
    if rows == "postgres":
        server: Postgres = request.getfixturevalue("postgres_server")
        options["database_url"] = server.new_database()
    if blobs == "s3":
        s3: S3Server = request.getfixturevalue("s3_server")
        client = s3_client(s3.endpoint, s3.access_key, s3.secret_key, checksums="when_required")
        options["blobs"] = S3Blobs(client, s3.bucket, prefix=f"{tmp_path.name}/")

    def open_store(state_dir: Any, **more: Any) -> JobStore:
        return JobStore.open(state_dir, **options, **more)

    return open_store
