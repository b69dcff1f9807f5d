"""A per-tenant bound on the distinct LoRA adapters its requests name in any minute.

An adapter the DiT has not loaded costs a load on its one compute thread (read, check, inject into the
transformer) that every tenant's requests wait behind, and once the DiT's adapter cache is full it evicts an
adapter someone else will load again. A tenant that names a new adapter with every request would spend the
DiT's time for everyone. So each tenant may name at most `adapters_per_minute` distinct adapters in any
WINDOW_S seconds: its quota in the tenants file, else the orchestrator's --adapters-per-minute (0 there: no
bound for tenants without the quota). Naming an adapter again inside the window is free.

`AdapterRate.take` is called at admission, after the request's other checks: over the bound it raises
RateLimited (RESOURCE_EXHAUSTED, with the seconds until enough of the tenant's adapters have left the window),
or LimitExceeded when one request names more distinct adapters than the bound (waiting cannot help). A refused
request counts nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from services.orchestrator.tenants import Clock, LimitExceeded, RateLimited, Tenant

# The adapters a tenant named in the last WINDOW_S seconds count against its adapters_per_minute.
WINDOW_S = 60.0
# The default of --adapters-per-minute: an adapter swap every 5 s on average, per tenant.
DEFAULT_ADAPTERS_PER_MINUTE = 12


class AdapterRate:
    """Per tenant, when each adapter it named was last named, for the last WINDOW_S seconds."""

    def __init__(self, default_per_minute: int = DEFAULT_ADAPTERS_PER_MINUTE, clock: Clock = time.monotonic) -> None:
        """`default_per_minute`: the bound of tenants whose quota does not set one (0: none)."""
        self.default_per_minute = default_per_minute
        self.clock = clock
        self._named: dict[str, dict[str, float]] = {}

    def limit(self, tenant: Tenant) -> int:
        """The tenant's bound (0: none)."""
        quota = tenant.quotas.adapters_per_minute
        return quota if quota is not None else self.default_per_minute

    def take(self, tenant: Tenant, names: Iterable[str]) -> None:
        """Counts a request's adapters against the tenant's bound; raises RateLimited or LimitExceeded over it."""
        wanted = list(dict.fromkeys(names))
        limit = self.limit(tenant)
        if not wanted or not limit:
            return
        now = self.clock()
        named = {name: at for name, at in self._named.get(tenant.name, {}).items() if now - at < WINDOW_S}
        if len(wanted) > limit:
            raise LimitExceeded(
                tenant.name,
                "loras",
                len(wanted),
                limit,
                f"loras: {len(wanted)} distinct adapters exceed tenant '{tenant.name}' limit of {limit} adapters per "
                "minute",
            )
        others = sorted(at for name, at in named.items() if name not in wanted)
        over = len(others) + len(wanted) - limit
        if over > 0:
            wait = max(others[over - 1] + WINDOW_S - now, 0.1)
            raise RateLimited(
                tenant.name,
                wait,
                f"loras: tenant '{tenant.name}' named {len(named)} distinct adapters in the last {WINDOW_S:g} s; its "
                f"limit is {limit} per minute (naming one of those again is free); retry in {wait:.1f} s",
            )
        for name in wanted:
            named[name] = now
        self._named[tenant.name] = named
