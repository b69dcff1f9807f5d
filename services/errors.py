"""Errors every service maps to a status code."""


class RequestError(ValueError):
    """A request a service refuses (INVALID_ARGUMENT); its message names the field and what is allowed."""
