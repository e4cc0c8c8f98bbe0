"""The injectable clock (proxy/clock.py): one fixed-width UTC format, and a ManualClock
whose sleepers wake only when a test advances it."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from proxy.clock import Clock, ManualClock, utc_iso

START = datetime(2026, 11, 29, 22, 59, 59, tzinfo=UTC)


def test_times_are_fixed_width_so_string_order_is_time_order() -> None:
    clock = ManualClock(START)
    assert clock.iso() == "2026-11-29T22:59:59.000000+00:00"
    clock.advance(1)
    assert clock.iso() == "2026-11-29T23:00:00.000000+00:00"
    assert len(Clock().iso()) == len(clock.iso())
    assert utc_iso(START) < clock.iso()


async def test_a_sleeper_wakes_when_time_reaches_it_and_not_before() -> None:
    clock = ManualClock(START)
    sleeper = asyncio.create_task(clock.sleep(10))
    await asyncio.sleep(0)
    clock.advance(timedelta(seconds=9))
    await asyncio.sleep(0)
    assert not sleeper.done()
    clock.advance(1)
    await asyncio.wait_for(sleeper, timeout=5)
    assert clock.now() == START + timedelta(seconds=10)


async def test_a_cancelled_sleeper_is_forgotten() -> None:
    clock = ManualClock(START)
    sleeper = asyncio.create_task(clock.sleep(10))
    await asyncio.sleep(0)
    sleeper.cancel()
    await asyncio.gather(sleeper, return_exceptions=True)
    assert clock._sleepers == []
    clock.advance(60)  # nothing left to wake
