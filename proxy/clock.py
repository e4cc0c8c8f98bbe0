"""Wall-clock time for the edges, in one format, from one injectable clock.

Every time the proxy stores or compares is a fixed-width UTC ISO-8601 string with
microseconds always printed, so string order is time order: the store's expiry,
heartbeat and ordering queries rely on it. The pure core never reads the clock; the
edges pass these strings in.

The application holds one `Clock` (the app key CLOCK in proxy/server/state.py); handlers
and background tasks read the time and sleep through it, so a test swaps in a
`ManualClock` and advances time instead of sleeping:

    clock = ManualClock()
    app = create_app(settings, clock=clock)
    clock.advance(timedelta(hours=25))   # idempotency records expire, heartbeats go stale
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta


def utc_iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


class Clock:
    """The system clock: what the proxy runs on outside tests."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def iso(self) -> str:
        return utc_iso(self.now())

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock's time (periodic tasks wait here)."""
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = Clock()


class ManualClock(Clock):
    """A clock that stands still until `advance` moves it; its sleepers wake when the
    time they wait for is reached. For tests: expiry, staleness and periodic steps
    without real waiting."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start if start is not None else datetime.now(UTC)
        self._sleepers: list[tuple[datetime, asyncio.Future[None]]] = []
        self._settling: list[tuple[int, asyncio.Future[None]]] = []  # advance_settled's

    def now(self) -> datetime:
        return self._now

    def advance(self, by: timedelta | float) -> None:
        """Move time forward and wake every sleeper whose time has come (they run at the
        caller's next await)."""
        self._now += by if isinstance(by, timedelta) else timedelta(seconds=by)
        waiting = []
        for wake_at, future in self._sleepers:
            if wake_at > self._now:
                waiting.append((wake_at, future))
            elif not future.done():
                future.set_result(None)
        self._sleepers = waiting

    async def advance_settled(self, by: timedelta | float, within: float = 10.0) -> None:
        """`advance`, then wait until as many sleepers wait as before: every periodic step
        the jump woke has run and slept again, so a test can assert what that step left,
        and the next jump is not merged into it. TimeoutError after `within` seconds."""
        asleep = len(self._sleepers)
        self.advance(by)
        if len(self._sleepers) >= asleep:
            return
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._settling.append((asleep, settled))
        try:
            await asyncio.wait_for(settled, within)
        finally:
            self._settling.remove((asleep, settled))

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self._now + timedelta(seconds=seconds), future)
        self._sleepers.append(entry)
        for asleep, settled in self._settling:
            if len(self._sleepers) >= asleep and not settled.done():
                settled.set_result(None)
        try:
            await future
        finally:
            if entry in self._sleepers:  # cancelled before its time
                self._sleepers.remove(entry)


def utc_now() -> str:
    return SYSTEM_CLOCK.iso()
