"""`eager`: a coroutine run at once up to its first real wait (Python 3.12's eager tasks).

A commit that must outlive its caller's cancellation is awaited as
`asyncio.shield(task)`; a task's steps each take a trip through the event loop, which
costs a SQLite commit that never waits (on the loop's own connection) more than the
commit itself. `eager(coro)` runs `coro` now: one that finishes without waiting gives a
future already done (shield returns it as is), one that waits goes on in a task.

    done = eager(commit())
    return await asyncio.shield(done)
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def eager(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """`coro` run to its first wait now, in the caller's context; the rest in a task."""
    try:
        waits_on = coro.send(None)
    except StopIteration as done:
        return _settled(done.value)
    except asyncio.CancelledError:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        future.cancel()
        return future
    except Exception as exc:
        failed: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        failed.set_exception(exc)
        return failed
    return asyncio.ensure_future(_Rest(coro, waits_on))


def _settled(value: T) -> asyncio.Future[T]:
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


_STARTED = object()


class _Rest(Coroutine[Any, Any, T]):
    """A started coroutine as a task drives it on: the first step gives what it waits on,
    then every send and throw (a cancel, before the first step too) goes to it."""

    def __init__(self, coro: Coroutine[Any, Any, T], waits_on: Any) -> None:
        self._coro = coro
        self._waits_on = waits_on

    def send(self, value: Any) -> Any:
        if self._waits_on is not _STARTED:
            waits_on, self._waits_on = self._waits_on, _STARTED
            return waits_on
        return self._coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self._waits_on = _STARTED
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, T]:
        raise TypeError("_Rest is driven by its task, not awaited")
