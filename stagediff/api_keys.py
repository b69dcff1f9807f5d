"""Which API key a client sends: the first of the argument, a key file, the environment, the default file."""

from __future__ import annotations

import os
from pathlib import Path

from stagediff.protocol import API_KEY_ENV, API_KEY_FILE_ENV, DEFAULT_API_KEY_FILE


def resolve_api_key(api_key: str | None = None, api_key_file: str | Path | None = None) -> str | None:
    """The API key a client sends, from the first of: `api_key`; the file `api_key_file`; $STAGEDIFF_API_KEY;
    the file $STAGEDIFF_API_KEY_FILE names; ~/.config/stagediff/api-key when it exists. None when there is none.

    A file holds the key alone (surrounding whitespace and a final newline are ignored).
    """
    if api_key is not None:
        return api_key or None
    if api_key_file is not None:
        return _read_api_key(Path(api_key_file).expanduser(), "api_key_file")
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV]
    if os.environ.get(API_KEY_FILE_ENV):
        return _read_api_key(Path(os.environ[API_KEY_FILE_ENV]).expanduser(), f"${API_KEY_FILE_ENV}")
    default = Path(DEFAULT_API_KEY_FILE).expanduser()
    return _read_api_key(default, DEFAULT_API_KEY_FILE) if default.is_file() else None


def _read_api_key(path: Path, name: str) -> str:
    try:
        key = path.read_text().strip()
    except OSError as error:
        raise ValueError(f"{name}: cannot read the API key file {path}: {error.strerror or error}") from None
    if not key or any(character.isspace() for character in key):
        raise ValueError(f"{name}: {path} must hold the API key alone, on one line")
    return key
