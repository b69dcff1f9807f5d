"""API keys: making them, hashing them for the tenants file, and reading them from a call's metadata.

Keys travel as `authorization: Bearer <key>` metadata; the tenants file holds only their SHA-256
(`sha256:<hex>`). An unsalted fast hash is the right tool here, unlike for passwords: keys are random
256-bit tokens, so there is nothing to guess and no dictionary to precompute; salting or stretching only
defends low-entropy secrets, and would force every request to try every tenant's salt with a slow
function. With a fast unsalted hash, a request costs one SHA-256 and one dict lookup. That lookup does not
compare the presented key with a stored one, only digests: what its timing could reveal is a prefix of a
digest, which does not help to find a key that hashes to it.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

from services.orchestrator.tenants.errors import AuthenticationError

AUTHORIZATION_METADATA_KEY = "authorization"
KEY_HASH_PREFIX = "sha256:"
KEY_PREFIX = "sd_"


def new_api_key() -> str:
    """A fresh API key: 256 random bits, URL-safe, with a prefix that secret scanners can spot."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """The form a key is stored in: `sha256:<hex>`."""
    return KEY_HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The key in `authorization: Bearer <key>`; raises AuthenticationError when absent or malformed."""
    values = [value for key, value in (metadata or ()) if key.lower() == AUTHORIZATION_METADATA_KEY]
    if not values:
        raise AuthenticationError(
            "missing API key: send metadata 'authorization: Bearer <key>' (ask the cluster's operator for a key)"
        )
    if len(values) > 1:
        raise AuthenticationError("more than one 'authorization' metadata entry; send exactly one")
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError("malformed 'authorization' metadata: expected 'Bearer <key>'")
    return token
