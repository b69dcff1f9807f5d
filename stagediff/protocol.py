"""Conventions shared by the SDK and the servers beyond the .proto files."""

# Trailing metadata the orchestrator sets when a call ends because its job failed
# or was cancelled: the error is the job's outcome, so retrying the call would
# only report it again.
JOB_FAILED_METADATA_KEY = "stagediff-job-failed"

# The environment variable the SDK and CLI read an API key from when none is given.
API_KEY_ENV = "STAGEDIFF_API_KEY"
