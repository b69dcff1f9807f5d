"""The opaque namespace that keeps one tenant's cached prompt embeddings apart from another's.

The text-encoder stage caches embeddings by text, and whether a request hit its
cache shows in the stage timings a client gets back. With one cache for every
tenant, a tenant could learn whether another recently sent an exact prompt. So
each EncodeRequest carries `cache_namespace` = HMAC-SHA256(key, tenant name):
the same for every request of one tenant (its repeated prompts still hit),
different between tenants (they never share an entry), and meaningless to the
stage, which is never told the tenant's name and cannot compute a namespace
without the key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

# Domain separation: the cluster secret also authenticates stage calls and keys the rank group's
# control channel; this key is derived from it for this one use, so it never equals either.
_KEY_LABEL = b"stagediff embedding cache namespace\0"


def cache_namespace_key(cluster_secret: str | None) -> bytes:
    """The per-cluster key of the namespaces: derived from the cluster secret when there is one, else random.

    Derived, the key (so each tenant's namespace) is the same across orchestrator restarts and for every
    orchestrator of the cluster, and the embeddings the stage cached for a tenant stay usable. Without a
    secret there is nothing stable and private to derive it from, so each orchestrator process draws its
    own: a restart only turns the cached embeddings into misses, which the stage's LRU then evicts.
    A stage holds the cluster secret, so it could test a guessed tenant name against a namespace; it cannot
    read a name out of one.
    """
    if cluster_secret is None:
        return secrets.token_bytes(32)
    return hmac.new(cluster_secret.encode(), _KEY_LABEL, hashlib.sha256).digest()


def tenant_cache_namespace(key: bytes, tenant: str) -> bytes:
    """The 32-byte namespace of `tenant`'s cached embeddings under the cluster's `key`."""
    return hmac.new(key, tenant.encode(), hashlib.sha256).digest()
