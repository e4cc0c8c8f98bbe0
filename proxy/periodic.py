"""The one way the proxy runs something every N seconds (heartbeats, recovery sweeps,
idempotency purges, policy reloads).

    async with running(every("sweep", 15, step, clock)):
        ...   # the loop runs here; on exit it is cancelled and awaited

A step that raises is logged with the loop's name and the loop keeps going (a database
blip must not end heartbeats for the life of the process). Time and waiting come from the
given clock, so a test with a ManualClock triggers a step by advancing time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import structlog

from proxy.clock import Clock

log = structlog.get_logger("threadkeeper.periodic")


async def every(
    name: str,
    interval: timedelta | float,
    step: Callable[[], Awaitable[object]],
    clock: Clock,
    *,
    first_now: bool = False,
) -> None:
    """Run `step` every `interval` until cancelled; with `first_now`, once at once too."""
    seconds = interval.total_seconds() if isinstance(interval, timedelta) else interval
    if first_now:
        await run_step(name, step)
    while True:
        await clock.sleep(seconds)
        await run_step(name, step)


async def run_step(name: str, step: Callable[[], Awaitable[object]]) -> None:
    """One step; a failure is logged, not raised (cancellation still propagates)."""
    try:
        await step()
    except Exception:
        log.exception("periodic_step_failed", task=name)


@asynccontextmanager
async def running(*loops: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Run the loops as tasks while the body runs; cancel and await them on exit, so none
    outlives its owner (a shutdown leaves no pending task behind)."""
    tasks = [asyncio.create_task(loop) for loop in loops]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
