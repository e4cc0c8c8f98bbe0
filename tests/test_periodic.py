"""The one periodic-task helper (proxy/periodic.py) on a ManualClock: steps run when time
passes, a failing step is logged and the loop goes on, and leaving `running` cancels the
loop cleanly."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from structlog.testing import capture_logs

from proxy.clock import ManualClock
from proxy.periodic import every, running


async def settled() -> None:
    """Lets woken tasks run to their next wait."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_steps_run_when_the_clock_passes_their_interval() -> None:
    clock, calls = ManualClock(), []

    async def step() -> None:
        calls.append(clock.iso())

    async with running(every("tick", timedelta(seconds=10), step, clock, first_now=True)):
        await settled()
        assert len(calls) == 1  # first_now
        clock.advance(9)
        await settled()
        assert len(calls) == 1
        clock.advance(1)
        await settled()
        assert len(calls) == 2


async def test_a_failing_step_is_logged_and_the_loop_goes_on() -> None:
    clock, calls = ManualClock(), []

    async def step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("database blip")

    with capture_logs() as logs:
        async with running(every("flaky", 5, step, clock)):
            await settled()
            for _ in range(3):
                clock.advance(5)
                await settled()
    assert len(calls) == 3
    [failure] = [entry for entry in logs if entry["event"] == "periodic_step_failed"]
    assert failure["task"] == "flaky"


async def test_leaving_running_cancels_the_loop_and_its_sleep() -> None:
    clock = ManualClock()

    async def step() -> None:
        pass

    loop = every("idle", 60, step, clock)
    async with running(loop):
        await settled()
        assert len(clock._sleepers) == 1
    assert clock._sleepers == []
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
