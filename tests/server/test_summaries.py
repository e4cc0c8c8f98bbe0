"""Background LLM summaries (proxy/server/summaries.py): bounded, stored, cancelled at
shutdown, failures logged and remembered, never raised."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from proxy.clock import ManualClock
from proxy.core.items import Item, chat_item
from proxy.core.llm_summary import Written
from proxy.core.memory import MemoryState
from proxy.core.projection import SummaryChunk
from proxy.core.tokens import TokenCounter
from proxy.metrics import Metrics
from proxy.policy import Policy
from proxy.server.summaries import RETRY_AFTER, BackgroundSummaries, Job
from proxy.store import open_store
from proxy.store.base import Store, StoredSummary
from proxy.summarizer import Target

POLICY = Policy.model_validate({"tenant": "acme", "memory": {"summarizer": {"model": "m"}}})
ITEMS = (chat_item({"role": "user", "content": "Never ship on Fridays."}),)


class FakeSummarizer:
    """Answers from a script: an item's text, None (a bad answer) or an exception; an
    Event makes the call wait until the test sets it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.script: list[Any] = []
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()  # set by the first call
        self.closed = False

    async def write(
        self,
        policy: Policy,
        target: Target,
        items: Sequence[Item],
        counter: TokenCounter,
        max_tokens: int,
        previous: Item | None = None,
        base: MemoryState | None = None,
    ) -> Written | None:
        self.calls.append(items[0].text())
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        outcome = self.script.pop(0) if self.script else "summary"
        if isinstance(outcome, Exception):
            raise outcome
        if outcome is None:
            return None
        return Written(chat_item({"role": "system", "content": outcome}), {"count": 1}, ())

    async def aclose(self) -> None:
        self.closed = True


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    store = await open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    await store.migrate()
    yield store
    await store.close()


@pytest.fixture
def fake() -> FakeSummarizer:
    return FakeSummarizer()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def background(
    store: Store, fake: FakeSummarizer, clock: ManualClock
) -> AsyncIterator[BackgroundSummaries]:
    background = BackgroundSummaries(
        store,
        fake,
        Metrics(),
        clock,
        max_running=2,
        max_per_tenant=1,  # type: ignore[arg-type]
    )
    yield background
    await background.aclose()


def job(digest: str, namespace: str = "acme", thread_id: str | None = None) -> Job:
    return Job(
        namespace=namespace,
        thread_id=thread_id,
        policy=POLICY,
        target=Target("http://upstream.test/v1", "key"),
        api="chat",
        digest=digest,
        items=ITEMS,
        max_tokens=500,
        previous=None,
        counter=TokenCounter.for_model("gpt-4o-mini"),
    )


async def test_a_written_summary_is_stored_and_ready_and_never_written_twice(
    background: BackgroundSummaries, store: Store, fake: FakeSummarizer
) -> None:
    ready = background.ready("acme", "m", "chat")
    assert ready.get("d1") is None and ready.missing() == ["d1"]
    assert background.submit(job("d1"))
    await background.idle()
    assert ready["d1"].text() == "summary" and ready.missing() == []
    stored = await store.summaries_get("acme", "m", "chat", ["d1"])
    assert stored["d1"].raw == {"role": "system", "content": "summary"}
    assert not background.submit(job("d1"))  # ready: no second call
    assert len(fake.calls) == 1


async def test_a_summary_another_process_stored_is_read_not_written(
    background: BackgroundSummaries, store: Store, fake: FakeSummarizer
) -> None:
    theirs = StoredSummary("acme", "m", "chat", "d1", {"role": "system", "content": "x"}, None, "t")
    await store.summary_put(theirs)
    ready = background.ready("acme", "m", "chat")
    assert "d1" not in ready  # asked for, not in memory ...
    assert await background.fetch(ready) == 1  # ... but in the store
    assert ready["d1"].text() == "x"
    background.submit(job("d2"))
    await store.summary_put(replace_digest(theirs, "d3"))
    background.submit(job("d3", namespace="acme"))  # the per-tenant cap: skipped for now
    await background.idle()
    assert fake.calls == ["Never ship on Fridays."]  # d2 only


def replace_digest(summary: StoredSummary, digest: str) -> StoredSummary:
    return StoredSummary(
        summary.tenant, summary.model, summary.api, digest, summary.raw, summary.state, "t"
    )


async def test_running_summaries_are_capped_per_tenant_and_per_process(
    background: BackgroundSummaries, fake: FakeSummarizer
) -> None:
    fake.gate = asyncio.Event()
    assert background.submit(job("a1", "acme"))
    assert not background.submit(job("a2", "acme"))  # acme has 1 running
    assert background.submit(job("b1", "beta"))
    assert not background.submit(job("c1", "gamma"))  # 2 running in the process
    skipped = background.metrics.summaries_skipped.labels("acme")._value.get()
    assert skipped == 2
    hold = asyncio.Event()
    assert not background.spawn("beta", "beta", ("beta", "predict", "t1"), hold.wait)
    fake.gate.set()
    await background.idle()
    assert background.spawn("beta", "beta", ("beta", "predict", "t1"), hold.wait)
    assert not background.submit(job("b2", "beta"))  # the prediction counts for beta
    hold.set()
    await background.idle()
    assert background.submit(job("a2", "acme"))  # room again
    await background.idle()


async def test_a_failed_summary_is_logged_and_not_retried_until_later(
    background: BackgroundSummaries, fake: FakeSummarizer, clock: ManualClock
) -> None:
    fake.script = [RuntimeError("provider exploded"), None]
    with capture_logs() as logs:
        assert background.submit(job("d1"))
        await background.idle()
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["summary_failed"]
    assert not background.submit(job("d1"))
    clock.advance(RETRY_AFTER + 1)
    assert background.submit(job("d1"))  # tried again: a bad answer this time
    await background.idle()
    assert not background.submit(job("d1"))
    assert len(fake.calls) == 2 and "d1" not in background.ready("acme", "m", "chat")


async def test_shutdown_cancels_running_summaries_and_closes_the_pool(
    store: Store, fake: FakeSummarizer, clock: ManualClock
) -> None:
    background = BackgroundSummaries(store, fake, Metrics(), clock)  # type: ignore[arg-type]
    fake.gate = asyncio.Event()  # never set: the call would wait forever
    assert background.submit(job("d1"))
    await fake.started.wait()
    await background.aclose()
    assert fake.closed
    assert not background.submit(job("d2"))  # nothing starts after shutdown
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("summary ")]
    assert await store.summaries_get("acme", "m", "chat", ["d1"]) == {}


async def test_a_summary_written_now_is_stored_read_back_and_not_retried_soon_after_failing(
    background: BackgroundSummaries, store: Store, fake: FakeSummarizer, clock: ManualClock
) -> None:
    """`now` (a compaction's, on its request's path): the stored summary when there is
    one; a failure gives None, logged, and is not tried again for RETRY_AFTER."""
    fake.script = [RuntimeError("boom"), None, "written"]
    with capture_logs() as logs:
        assert await background.now(job("c1")) is None  # raised: logged, not raised
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["summary_failed"]
    assert await background.now(job("c1")) is None  # failed lately: no second call
    assert len(fake.calls) == 1
    clock.advance(RETRY_AFTER + 1)
    assert await background.now(job("c1")) is None  # a bad answer
    clock.advance(RETRY_AFTER + 1)
    written = await background.now(job("c1"))
    assert written is not None and written.raw["content"] == "written"
    assert written.state == {"count": 1}
    assert (await store.summaries_get("acme", "m", "chat", ["c1"]))["c1"] == written
    again = await background.now(job("c1"))
    assert again == written and len(fake.calls) == 3  # read from the store
    await background.aclose()
    assert await background.now(job("c2")) is None and len(fake.calls) == 3


async def stored_digests(store: Store, *digests: str) -> list[str]:
    return sorted(await store.summaries_get("acme", "m", "chat", list(digests)))


async def test_a_summary_written_for_a_thread_is_deleted_with_it(
    background: BackgroundSummaries, store: Store, clock: ManualClock
) -> None:
    await store.create_thread("acme", "t1", kind="chat", now=clock.iso())
    background.submit(job("d1", thread_id="t1"))
    await background.idle()
    background.submit(job("d2"))  # a stateless request's
    await background.idle()
    assert await stored_digests(store, "d1", "d2") == ["d1", "d2"]
    assert await store.delete_thread("acme", "t1")
    assert await stored_digests(store, "d1", "d2") == ["d2"]


async def test_a_summary_stored_before_is_kept_for_the_thread_that_wants_it(
    background: BackgroundSummaries, store: Store, fake: FakeSummarizer, clock: ManualClock
) -> None:
    theirs = StoredSummary("acme", "m", "chat", "d1", {"role": "system", "content": "x"}, None, "t")
    await store.summary_put(theirs)  # written for a stateless request
    await store.create_thread("acme", "t1", kind="chat", now=clock.iso())
    background.submit(job("d1", thread_id="t1"))
    await background.idle()
    assert fake.calls == []
    await store.delete_thread("acme", "t1")
    assert await stored_digests(store, "d1") == []


async def test_a_summary_whose_thread_is_deleted_meanwhile_is_not_kept(
    background: BackgroundSummaries, store: Store, fake: FakeSummarizer, clock: ManualClock
) -> None:
    """Deleted while the summarizer wrote it: neither the store nor memory keeps it."""
    await store.create_thread("acme", "t1", kind="chat", now=clock.iso())
    fake.gate = asyncio.Event()
    background.submit(job("d1", thread_id="t1"))
    await fake.started.wait()
    await store.delete_thread("acme", "t1")
    fake.gate.set()
    await background.idle()
    assert fake.calls == ["Never ship on Fridays."]
    assert await stored_digests(store, "d1") == []
    ready = background.ready("acme", "m", "chat")
    assert ready.get("d1") is None


async def test_forget_drops_a_tenants_summaries_from_memory(
    background: BackgroundSummaries,
) -> None:
    background.submit(job("d1"))
    await background.idle()
    background.submit(job("d2", namespace="other"))
    await background.idle()
    background.forget("acme")
    assert background.ready("acme", "m", "chat").get("d1") is None
    assert background.ready("other", "m", "chat").get("d2") is not None


async def test_purge_keeps_what_was_served_within_the_retention_and_deletes_the_rest(
    background: BackgroundSummaries, store: Store, clock: ManualClock
) -> None:
    retention = timedelta(days=30)
    background.submit(job("d1"))
    await background.idle()
    background.submit(job("d2"))
    await background.idle()
    clock.advance(timedelta(days=29))
    assert await background.purge(retention) == 0  # both written 29 days ago
    ready = background.ready("acme", "m", "chat")
    assert ready.get("d1") is None  # the step emptied memory: read again from the store
    assert await background.fetch(ready) == 1  # d1 only: was asked for
    assert ready["d1"].text() == "summary"  # served: marked used at the next step
    clock.advance(timedelta(days=2))
    assert await background.purge(retention) == 1  # d2, unused for 31 days
    assert await stored_digests(store, "d1", "d2") == ["d1"]
    clock.advance(timedelta(days=29))
    assert await background.purge(retention) == 0  # d1, marked used 29 days ago
    clock.advance(timedelta(days=2))
    assert await background.purge(retention) == 1
    assert await stored_digests(store, "d1", "d2") == []


def sent(digest: str, text: str) -> SummaryChunk:
    """A block a projection sends as the deterministic digest."""
    block = chat_item({"role": "system", "content": text})
    return SummaryChunk(digest, ITEMS, 500, None, block)


async def test_a_claimed_digest_wins_over_a_summary_written_later(
    background: BackgroundSummaries, store: Store, fake: FakeSummarizer, clock: ManualClock
) -> None:
    """A stateless request stores the digest it sends; a prediction of the same chunk
    finishing afterwards finds it stored and keeps it, and so does another process."""
    fake.gate = asyncio.Event()
    assert background.submit(job("d1"))  # a prediction, still being written
    await fake.started.wait()
    ready = background.ready("acme", "m", "chat")
    assert await background.claim(ready, [sent("d1", "the digest")]) == 0
    fake.gate.set()
    await background.idle()
    assert ready["d1"].text() == "the digest"
    assert (await store.summaries_get("acme", "m", "chat", ["d1"]))["d1"].state is None
    # Another process that sent its own digest of d1 (it had not seen the stored one)
    # loses the claim and is handed the stored one to send instead.
    other = BackgroundSummaries(store, FakeSummarizer(), Metrics(), clock)  # type: ignore[arg-type]
    theirs = other.ready("acme", "m", "chat")
    assert await other.claim(theirs, [sent("d1", "another digest")]) == 1
    assert theirs["d1"].text() == "the digest"
    await other.aclose()
