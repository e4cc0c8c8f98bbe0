"""proxy.eager: a coroutine that never waits is done before the loop runs anything else;
one that waits goes on in a task that a shield keeps from its caller's cancellation."""

from __future__ import annotations

import asyncio

import pytest

from proxy.eager import eager


async def test_a_coroutine_that_never_waits_is_done_at_once() -> None:
    ran: list[str] = []
    asyncio.get_running_loop().call_soon(ran.append, "loop")

    async def quick() -> int:
        return 7

    done = eager(quick())
    assert done.done() and ran == []
    assert await asyncio.shield(done) == 7
    assert ran == []  # no trip through the loop


async def test_an_error_before_any_wait_is_raised_by_the_future() -> None:
    async def broken() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        await eager(broken())


async def test_a_coroutine_that_waits_goes_on_in_a_task_and_outlives_a_cancelled_caller() -> None:
    gate = asyncio.Event()
    steps: list[str] = []

    async def slow() -> str:
        steps.append("first")
        await gate.wait()
        steps.append("second")
        await asyncio.sleep(0)
        return "written"

    future = eager(slow())
    assert steps == ["first"] and not future.done()
    caller = asyncio.ensure_future(asyncio.shield(future))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    gate.set()
    assert await future == "written"
    assert steps == ["first", "second"]


async def test_cancelling_the_task_reaches_the_coroutine() -> None:
    cleaned: list[str] = []

    async def waits() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            cleaned.append("finally")

    future = eager(waits())
    future.cancel()
    with pytest.raises(asyncio.CancelledError):
        await future
    assert cleaned == ["finally"]
