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


async def test_advance_settled_returns_once_the_step_it_woke_has_run() -> None:
    """A periodic step that takes real time (a store write) is finished, and its loop
    asleep again, when advance_settled returns; a bare advance leaves it running."""
    clock = ManualClock(START)
    steps: list[datetime] = []

    async def loop() -> None:
        while True:
            await clock.sleep(600)
            await asyncio.sleep(0.05)  # the step's own I/O
            steps.append(clock.now())

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await clock.advance_settled(timedelta(minutes=10))
    assert steps == [START + timedelta(minutes=10)]
    await clock.advance_settled(timedelta(seconds=1))  # wakes nobody: returns at once
    assert len(steps) == 1
    clock.advance(timedelta(minutes=10))
    await asyncio.sleep(0)
    assert len(steps) == 1  # a bare advance: the step is still running
    task.cancel()
