"""Errors every service maps to a status code, and the one compute raises when its caller has gone."""


class RequestError(ValueError):
    """A request a service refuses (INVALID_ARGUMENT); its message names the field and what is allowed."""


class Cancelled(Exception):
    """Raised inside compute when the caller has gone away or cancelled."""


class NotFoundError(LookupError):
    """A request names something the service does not have, such as a LoRA adapter (NOT_FOUND)."""


# A status message travels in a trailer, percent-encoded (up to 3 bytes for each byte of UTF-8), and grpc drops
# trailers beyond its metadata limit (8 KiB soft, 16 KiB hard): the client then sees RESOURCE_EXHAUSTED instead of
# the status. Messages that quote a client's value (a job id, a model name, a tensor name) are kept well below.
MAX_STATUS_MESSAGE_BYTES = 1024


def bounded(message: str, limit: int = MAX_STATUS_MESSAGE_BYTES) -> str:
    """`message`, shortened in the middle to about `limit` UTF-8 bytes when longer (its start and end are kept)."""
    data = message.encode()
    if len(data) <= limit:
        return message
    half = limit // 2
    head = data[:half].decode(errors="ignore")
    tail = data[-half:].decode(errors="ignore")
    return f"{head} [... {len(data) - 2 * half} bytes cut ...] {tail}"
