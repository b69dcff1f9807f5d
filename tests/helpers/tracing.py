"""A fixed W3C trace context, as a caller would send it."""

from __future__ import annotations

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
