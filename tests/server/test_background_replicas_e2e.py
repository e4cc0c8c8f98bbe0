"""Background mode with two app instances on one database (two replicas), on a SQLite
file and on PostgreSQL:
the one that did not start a response answers its poll and resumption, and its cancel
reaches the one that runs it."""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.fake_provider import Reply
from proxy.server.background import RUNS

from .conftest import Proxy
from .test_background_e2e import MODEL, TENANT, until


async def test_two_replicas_poll_resume_and_cancel_each_others(
    store_url: str,
    make_proxy: Any,
) -> None:
    """Two app instances on one database: the one that did not start the
    response answers the poll and the resumption, and its cancel reaches the other."""
    settings = {"background_poll_seconds": 0.05}
    one: Proxy = await make_proxy(store_url=store_url, settings=settings)
    two: Proxy = await make_proxy(store_url=store_url, settings=settings)
    release = asyncio.Event()
    one.provider.script.append(Reply(text="alpha beta gamma", release=release, release_after=2))
    stream = await one.client().responses.create(
        model=MODEL, input="go", background=True, stream=True
    )
    first = [event async for event in _take(stream, 2)]
    await stream.close()
    response_id = first[0].response.id
    other = two.client()
    assert (await other.responses.retrieve(response_id)).status == "in_progress"
    release.set()
    resumed = await other.responses.retrieve(response_id, stream=True, starting_after=1)
    rest = [event async for event in resumed]
    assert rest[0].sequence_number == 2 and rest[-1].type == "response.completed"
    assert (await other.responses.retrieve(response_id)).output_text == "alpha beta gamma"

    hold = asyncio.Event()
    one.provider.script.append(Reply(text="never", release=hold))
    running = await one.client().responses.create(model=MODEL, input="x", background=True)
    cancelled = await other.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    runs = one.app[RUNS]  # type: ignore[index]

    async def stopped() -> bool:
        return (TENANT, running.id) not in runs.runs

    await until(stopped, "the cancel reached the replica running it")
    hold.set()

    async def aborted() -> bool:
        return one.provider.aborted == 1

    await until(aborted, "the provider's request aborted")
    assert (await one.client().responses.retrieve(running.id)).status == "cancelled"


async def _take(stream: Any, count: int) -> Any:
    taken = 0
    async for event in stream:
        yield event
        taken += 1
        if taken == count:
            return
