"""Conventions shared by the SDK and the servers beyond the .proto files."""

# Trailing metadata the orchestrator sets when a call ends because its job failed
# or was cancelled: the error is the job's outcome, so retrying the call would
# only report it again.
JOB_FAILED_METADATA_KEY = "stagediff-job-failed"

# The environment variable the SDK and CLI read an API key from when none is given.
API_KEY_ENV = "STAGEDIFF_API_KEY"

# Where the SDK and CLI read an API key from a file when none is given and $STAGEDIFF_API_KEY is unset: the
# file this variable names, else DEFAULT_API_KEY_FILE when it exists. A key in a file stays out of `ps`.
API_KEY_FILE_ENV = "STAGEDIFF_API_KEY_FILE"
DEFAULT_API_KEY_FILE = "~/.config/stagediff/api-key"

# GenerateRequest.output_format: each format a request may name, and the media type of its encoded result
# (JobCompleted.media_type, EncodedChunk.media_type); raw frames have none.
RAW_OUTPUT_FORMAT = "raw"
OUTPUT_FORMATS = {
    RAW_OUTPUT_FORMAT: "",
    "mp4": "video/mp4",
    "webm": "video/webm",
    "gif": "image/gif",
    "png": "image/png",
    "jpeg": "image/jpeg",
    "webp": "image/webp",
}

# The file extensions of each media type of an encoded result: the files its bytes are written to as they are.
MEDIA_TYPE_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "video/mp4": (".mp4",),
    "video/webm": (".webm",),
    "image/gif": (".gif",),
    "image/png": (".png",),
    "image/jpeg": (".jpg", ".jpeg"),
    "image/webp": (".webp",),
}

# The output format each result file's extension (the CLI's --out) asks the server for when no format is named:
# the server encodes the file (.npz: raw frames, written by the client).
FORMAT_OF_EXTENSION = {
    extension: name
    for name, media_type in OUTPUT_FORMATS.items()
    for extension in MEDIA_TYPE_EXTENSIONS.get(media_type, ())
} | {".npz": RAW_OUTPUT_FORMAT}

# The job states by the names the CLI takes (`stagediff jobs --state`): JobState's JOB_STATE_<NAME>.
JOB_STATE_NAMES = ("queued", "running", "succeeded", "failed", "cancelled")

# The exit code of a client command that Ctrl-C ended (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
