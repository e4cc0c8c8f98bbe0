"""Wall-clock time for the edges, in one format.

Every time the proxy stores or compares is a fixed-width UTC ISO-8601 string with
microseconds always printed, so string order is time order: the store's expiry,
heartbeat and ordering queries rely on it. The pure core never reads the clock; the
edges pass these strings in.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utc_iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def utc_now() -> str:
    return utc_iso(datetime.now(UTC))


def utc_hour() -> str:
    """The current hour, e.g. "2026-11-29T22:00Z": the time written into compressed tool
    results. Coarse on purpose: a result compressed again on the next turn comes out
    byte-identical, so the prompt prefix (and the provider's prompt cache) holds."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:00Z")
