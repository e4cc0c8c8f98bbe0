"""LLM summaries in the background, never on a request's path (issue 10, item 2).

A turn never waits for the summarizer: its projection uses the LLM summaries already
written for the chunks it cuts (`ProjectionRequest.summaries`, by chunk digest) and the
deterministic digest for any other. After the turn has been relayed, the summaries that
were missing are written in the background and stored (the `summaries` table, by
tenant, summarizer model, api and chunk digest), so a later request finds them:

- a stateless client that resends its history gets the LLM summary of a chunk its
  history is cut into when it was written before the chunk was first sent (predicted,
  as below); a chunk first sent with the deterministic digest keeps it, here and in any
  other process: the digest is stored as the chunk's summary before it is sent
  (`claim`), and an LLM summary finished later for it is not stored;
- a stateful thread whose history crossed `memory.summarizer.high_water` of its budget
  gets its next cut's summary written before that cut is made; a cut already sent with
  the deterministic digest keeps it (the thread's prefix stays byte-identical).

A compaction is the exception (proxy/server/compaction.py): it seals its summary before
it answers, so it writes it `now`, bounded by the summarizer's timeout, and stores it the
same way (by the compaction's own digest); a compaction whose summary failed is not
tried again for `retry_after` seconds.

A summary written for a stored thread is kept for that thread in the store and deleted
with the last thread it is kept for; one written for a stateless request is left to the
retention: `purge`, every PURGE_INTERVAL_SECONDS, marks what this process served since
its last step as used and deletes what went unused for `summary_retention_seconds`. It
also empties the in-memory cache, which then refills from the store: a summary that
another process deleted with its thread (the CLI, another replica) is served from here
for one interval at most; this process forgets a tenant's at once when it deletes one of
its threads or items (`forget`).

Background work is bounded: at most `max_running` summaries at a time in the process
and `max_per_tenant` per tenant; beyond that a summary is skipped (counted, the
deterministic digest stands), never queued without bound. A summary that failed is not
tried again for `retry_after` seconds. Errors are logged, never raised into a request;
`aclose` (the app's cleanup) cancels what is still running and waits for it.

    background = BackgroundSummaries(store, LlmSummarizer(metrics), metrics, clock)
    ready = background.ready(tenant, model, "chat")        # a Mapping for the projection
    background.submit(Job(...))                            # after the turn
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

import structlog

from proxy.clock import Clock, utc_iso
from proxy.core.items import Item, item_of
from proxy.core.memory import MemoryState
from proxy.core.projection import Projection, SummaryChunk
from proxy.core.tokens import TokenCounter
from proxy.metrics import Metrics
from proxy.policy import Policy
from proxy.store.base import MAX_SUMMARY_DIGESTS, StoredSummary, SummaryStore
from proxy.summarizer import LlmSummarizer, Target
from proxy.threads import Loaded

log = structlog.get_logger("threadkeeper.summaries")

MAX_RUNNING = 16
MAX_PER_TENANT = 4
CACHE_ENTRIES = 4096  # summary items kept in memory (each a few KB)
RETRY_AFTER = 300.0  # seconds before a chunk whose summary failed is tried again
PURGE_INTERVAL_SECONDS = 600.0

Key = tuple[str, str, str, str]  # (namespace, summarizer model, api, chunk digest)
K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True)
class Job:
    """One chunk to summarize: whose, with what, and the items it holds."""

    namespace: str  # the store's tenant key (auth.store_namespace)
    thread_id: str | None  # the stored thread the chunk is from; None: a stateless request
    policy: Policy
    target: Target
    api: str
    digest: str  # the chunk's key (proxy/core/projection.py, chunk_digest)
    items: Sequence[Item] = field(repr=False)
    max_tokens: int  # the room the projection gives the chunk's summary
    previous: Item | None = field(repr=False)  # the summary the chunk extends, if any
    counter: TokenCounter = field(repr=False)
    base: MemoryState | None = field(default=None, repr=False)  # the state `previous` renders

    @property
    def key(self) -> Key:
        assert self.policy.memory.summarizer is not None
        return (self.namespace, self.policy.memory.summarizer.model, self.api, self.digest)


class Ready(Mapping[str, Item]):
    """The LLM summaries a projection may use, by chunk digest; remembers which digests
    it was asked for, so the ones it lacked can be read from the store or written."""

    def __init__(
        self, cache: Mapping[Key, Item], prefix: tuple[str, str, str], used: dict[Key, None]
    ) -> None:
        self._cache = cache
        self.prefix = prefix  # (namespace, summarizer model, api)
        self._used = used
        self.asked: dict[str, None] = {}  # digests asked for, in order (a set with order)

    def __getitem__(self, digest: str) -> Item:
        self.asked[digest] = None
        key = (*self.prefix, digest)
        item = self._cache.get(key)
        if item is None:
            raise KeyError(digest)
        _mark_used(self._used, key)
        return item

    def __iter__(self) -> Iterator[str]:
        """The digests ready now (a snapshot: the loop may add entries meanwhile)."""
        prefix = self.prefix
        return iter([key[3] for key in list(self._cache) if key[:3] == prefix])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def missing(self) -> list[str]:
        """Digests asked for that had no summary."""
        return [d for d in self.asked if (*self.prefix, d) not in self._cache]


class BackgroundSummaries:
    """The process's background summaries: a bounded set of tasks and the summaries
    they wrote (an in-memory cache in front of the store)."""

    def __init__(
        self,
        store: SummaryStore,
        summarizer: LlmSummarizer,
        metrics: Metrics,
        clock: Clock,
        *,
        max_running: int = MAX_RUNNING,
        max_per_tenant: int = MAX_PER_TENANT,
    ) -> None:
        self.store = store
        self.summarizer = summarizer
        self.metrics = metrics
        self.clock = clock
        self.max_running = max_running
        self.max_per_tenant = max_per_tenant
        self._cache: dict[Key, Item] = {}
        self._used: dict[Key, None] = {}  # served since the last purge step (a set with order)
        self._kept: dict[tuple[Key, str], None] = {}  # summaries known kept for a thread
        self._running: dict[tuple[str, ...], asyncio.Task[None]] = {}
        self._failed: dict[Key, datetime] = {}
        # Per (namespace, thread): the cut a next cut was last predicted after; predicting
        # again before that cut changes would find the same chunk (observe.SummariesAhead).
        self.predicted: dict[tuple[str, str], int] = {}
        self._closed = False  # after aclose nothing starts (a request ending late)

    def ready(self, namespace: str, model: str, api: str) -> Ready:
        return Ready(self._cache, (namespace, model, api), self._used)

    async def fetch(self, ready: Ready) -> int:
        """Reads the summaries `ready` lacked from the store (another process, or an
        earlier life of this one, wrote them); how many it found."""
        wanted = ready.missing()[:MAX_SUMMARY_DIGESTS]
        if not wanted:
            return 0
        namespace, model, api = ready.prefix
        found = await self.store.summaries_get(namespace, model, api, wanted)
        for digest, stored in found.items():
            key = (namespace, model, api, digest)
            self._remember(key, _item(stored))
            _mark_used(self._used, key)
        return len(found)

    async def claim(self, ready: Ready, chunks: Sequence[SummaryChunk]) -> int:
        """Stores the deterministic digests a stateless request is about to send as the
        summaries of their chunks (the first write wins), so that no LLM summary written
        later for them (a prediction still running) changes the prefix, in this process
        or any other. How many were stored first by someone else: those are read into
        the cache, and the request is projected again to send them."""
        namespace, model, api = ready.prefix
        lost: list[str] = []
        for chunk in chunks[:MAX_SUMMARY_DIGESTS]:
            key = (namespace, model, api, chunk.digest)
            if key in self._cache:
                continue
            claimed = StoredSummary(
                tenant=namespace,
                model=model,
                api=chunk.summary.api,
                digest=chunk.digest,
                raw=chunk.summary.raw,
                state=None,
                created_at=self.clock.iso(),
            )
            if await self.store.summary_put(claimed):
                self._remember(key, chunk.summary)
            else:
                lost.append(chunk.digest)
        if not lost:
            return 0
        found = await self.store.summaries_get(namespace, model, api, lost)
        for digest, stored in found.items():
            self._remember((namespace, model, api, digest), _item(stored))
        return len(found)

    def submit(self, job: Job) -> bool:
        """Starts writing `job`'s summary unless it is ready, running, failed lately, or
        the caps are reached (then it is counted as skipped); True when started."""
        if not self._wanted(job.key):
            return False
        return self.spawn(job.namespace, job.policy.tenant, job.key, lambda: self._run(job))

    def spawn(
        self,
        namespace: str,
        tenant: str,
        key: tuple[str, ...],
        work: Callable[[], Coroutine[Any, Any, None]],
        *,
        capped: bool = True,
    ) -> bool:
        """Runs `work()` as a background task under the caps, once per `key` at a time
        (`key[0]` is the namespace the per-tenant cap counts); False (counted as skipped
        when a cap is reached) when it is not started. What `work` raises is logged.
        `capped=False`: work that calls no summarizer (one store write) is not capped."""
        if key in self._running or self._closed:
            return False
        tenant_running = sum(1 for k in self._running if k[0] == namespace)
        if capped and (
            len(self._running) >= self.max_running or tenant_running >= self.max_per_tenant
        ):
            self.metrics.summaries_skipped.labels(tenant).inc()
            log.info("summary_skipped", tenant=tenant, key=key[-1])
            return False
        task = asyncio.create_task(_logged(work(), tenant), name=f"summary {key[-1][:16]}")
        self._running[key] = task
        task.add_done_callback(lambda _: self._running.pop(key, None))
        return True

    def _wanted(self, key: Key) -> bool:
        return key not in self._cache and key not in self._running and not self._failed_lately(key)

    async def run_now(self, job: Job) -> None:
        """Writes `job`'s summary inside an already running background task (one that
        found its chunks itself), unless it is ready, running or failed lately."""
        if self._wanted(job.key):
            await self._run(job)

    async def _run(self, job: Job) -> None:
        """Never raises (but cancellation): a failure is logged and remembered."""
        key = job.key
        try:
            summary = await self._obtain(job)
        except Exception:
            self._fail(key)
            log.exception("summary_failed", tenant=job.policy.tenant, digest=job.digest)
            return
        if summary is None:
            self._fail(key)
        else:
            self._remember(key, _item(summary))

    async def now(self, job: Job) -> StoredSummary | None:
        """`job`'s summary on the caller's path (a compaction seals it before it answers):
        the stored one, else written now and stored. None when it fails (logged), or
        failed lately: it is not tried again for RETRY_AFTER seconds, so a summarizer
        that times out does not hold every request for its timeout."""
        key = job.key
        if self._closed or self._failed_lately(key):
            return None
        try:
            summary = await self._obtain(job)
        except Exception:
            log.exception("summary_failed", tenant=job.policy.tenant, digest=job.digest)
            summary = None
        if summary is None:
            self._fail(key)
        return summary

    async def _obtain(self, job: Job) -> StoredSummary | None:
        """The stored summary of `job`, else the one its summarizer writes now (stored;
        when another process stored one first, that one); None when none is written, or
        when the thread it is for was deleted meanwhile (then nothing is stored)."""
        key = job.key
        stored = await self.store.summaries_get(key[0], key[1], key[2], [job.digest])
        if job.digest in stored:
            if job.thread_id is not None:
                await self.keep(key[:3], job.thread_id, [job.digest])
            _mark_used(self._used, key)
            return stored[job.digest]
        written = await self.summarizer.write(
            job.policy, job.target, job.items, job.counter, job.max_tokens, job.previous, job.base
        )
        if written is None:
            return None
        summary = StoredSummary(
            tenant=job.namespace,
            model=key[1],
            api=written.item.api,
            digest=job.digest,
            raw=written.item.raw,
            state=written.state,
            created_at=self.clock.iso(),
        )
        if not await self.store.summary_put(summary, thread_id=job.thread_id):
            # Another process was first, or the thread was deleted meanwhile (then
            # nothing was stored, and nothing is kept here either).
            stored = await self.store.summaries_get(key[0], key[1], key[2], [job.digest])
            return stored.get(job.digest)
        if job.thread_id is not None:
            bounded_put(self._kept, (key, job.thread_id), None)
        return summary

    def _failed_lately(self, key: Key) -> bool:
        failed = self._failed.get(key)
        if failed is None:
            return False
        if (self.clock.now() - failed).total_seconds() < RETRY_AFTER:
            return True
        del self._failed[key]
        return False

    def _fail(self, key: Key) -> None:
        bounded_put(self._failed, key, self.clock.now())

    def _remember(self, key: Key, item: Item) -> None:
        bounded_put(self._cache, key, item)

    async def keep(
        self, prefix: tuple[str, str, str], thread_id: str, digests: Sequence[str]
    ) -> None:
        """The stored summaries of these digests are kept for the thread too (it uses
        them), once per process."""
        wanted = [d for d in digests if ((*prefix, d), thread_id) not in self._kept]
        if not wanted:
            return
        namespace, model, api = prefix
        await self.store.summaries_keep(
            namespace, thread_id, model, api, wanted[:MAX_SUMMARY_DIGESTS]
        )
        for digest in wanted[:MAX_SUMMARY_DIGESTS]:
            bounded_put(self._kept, ((*prefix, digest), thread_id), None)

    def keep_later(
        self, tenant: str, prefix: tuple[str, str, str], thread_id: str, digests: Sequence[str]
    ) -> None:
        """`keep` in the background."""
        wanted = [d for d in digests if ((*prefix, d), thread_id) not in self._kept]
        if wanted:
            key = (prefix[0], "keep", thread_id)  # the namespace first, as spawn wants
            self.spawn(
                prefix[0], tenant, key, lambda: self.keep(prefix, thread_id, wanted), capped=False
            )

    def forget(self, namespace: str) -> None:
        """Drops the namespace's summaries from memory: one of its threads was deleted,
        and what the store deleted with it must not be served from here."""
        for key in [key for key in self._cache if key[0] == namespace]:
            del self._cache[key]
        for kept in [kept for kept in self._kept if kept[0][0] == namespace]:
            del self._kept[kept]

    async def touch(self) -> None:
        """Marks the summaries served since the last call used now, in the store."""
        used = list(self._used)
        await self.store.summaries_touch(used, self.clock.iso())
        for key in used:
            self._used.pop(key, None)

    async def purge(self, retention: timedelta) -> int:
        """One retention step (see the module docstring); how many summaries the store
        deleted."""
        await self.touch()
        purged = await self.store.summaries_purge(utc_iso(self.clock.now() - retention))
        self._cache.clear()
        self._kept.clear()
        return purged

    async def idle(self) -> None:
        """Waits until no summary is being written (tests; a drain before shutdown)."""
        while self._running:
            await asyncio.gather(*list(self._running.values()), return_exceptions=True)

    async def aclose(self) -> None:
        """Cancels what is running and waits for it; closes the summarizer's pool."""
        self._closed = True
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.summarizer.aclose()


def _item(stored: StoredSummary) -> Item:
    return item_of(stored.api, stored.raw)


def _mark_used(used: dict[Key, None], key: Key) -> None:
    if key not in used:
        bounded_put(used, key, None)


def bounded_put(entries: dict[K, V], key: K, value: V) -> None:
    """Puts an entry, first dropping the oldest ones beyond CACHE_ENTRIES."""
    while len(entries) >= CACHE_ENTRIES:
        del entries[next(iter(entries))]
    entries[key] = value


async def _logged(work: Coroutine[Any, Any, None], tenant: str) -> None:
    try:
        await work
    except Exception:
        log.exception("background_summary_failed", tenant=tenant)


def kept_for(loaded: Loaded | None, committed: bool = False) -> str | None:
    """The thread a turn's summaries are kept for (deleted with it): the stored thread,
    or the one the turn's commit created (`committed`); None for a stateless request and
    for one that stored nothing (a Responses `store: false` request starting no chain)."""
    if loaded is None or (loaded.thread is None and not committed):
        return None
    return loaded.thread_id


def sent_chunks(projection: Projection) -> list[SummaryChunk]:
    """The blocks the projection sends as the deterministic digest (Projection.chunks
    lists only blocks sent; `ready` ones are LLM summaries already)."""
    return [chunk for chunk in projection.chunks if not chunk.ready]


def replayed(loaded: Loaded | None) -> bool:
    """Whether the turn's history is the client's alone, its cut replayed with no
    stored cut: no thread, or one not stored yet (a Responses `store: false` request
    without a previous response is sent again whole; a new thread that is stored is not,
    and only wastes one summary when it arrives over budget)."""
    return loaded is None or loaded.thread is None
