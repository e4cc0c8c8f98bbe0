"""The storage contract: one async Protocol per concern (threads and items, responses,
background responses, heartbeats, ledger, idempotency, summaries, explain records,
secrets, upstream APIs, inspector sessions, learned limits) and `Store`, their union,
which the SQL store implements for SQLite and PostgreSQL. A consumer takes the narrow
protocol it uses, so its annotation says which tables it can touch.

Layers (SPEC section 2): the event log (`items`, append-only per thread, with a sequence
number), the thread state / checkpoint (`threads.state` with a `version` for optimistic
concurrency), responses, and the idempotency tables (side-effect ledger, request
idempotency records). Every row is scoped by tenant: a row of one tenant is invisible
(None / not found) to every other.

Writes that must not be half-done are single transactions: `commit_turn` appends a
response's input and output items, advances the thread state and completes the response
record at once, or does nothing and raises `VersionConflict`.

Example::

    store = await open_store("sqlite:///./threadkeeper.db")
    await store.migrate()
    thread = await store.create_thread("acme", "conv_1", kind="conversation", now=now)
    window = await store.load_window("acme", "conv_1")
    version = await store.commit_turn(
        "acme", "conv_1", expected_version=window.thread.version, items=[...],
        state=new_state, now=now,
    )
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from proxy.core.items import JsonDict, content_digest

ThreadKind = Literal["conversation", "chat", "responses"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
LedgerStatus = Literal["issued", "completed", "failed"]


class StoreError(Exception):
    """Base class of the store's own errors."""


class VersionConflict(StoreError):
    """The thread changed since it was read: reload, merge, retry (SPEC section 7)."""


class NotFound(StoreError):
    """The thread, item or response does not exist for this tenant."""


class AlreadyExists(StoreError):
    """A row with this key exists (first write wins)."""


class Cancelled(StoreError):
    """The response was cancelled first (a background response, POST .../cancel): the
    completion that lost the race wrote nothing."""


class TooManyRunning(StoreError):
    """begin_response refused a background response: the tenant already runs `limit`
    (policy background.max_running); nothing was written."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} background responses already running")
        self.limit = limit


class StoreUnavailable(StoreError):
    """The store cannot serve now: unreachable, too slow (the store timeouts), or out of
    space. Raised by the backends for these causes only (a bug stays a bug); the HTTP
    layer answers 503 with Retry-After, and the same store recovers without a restart."""


@dataclass(frozen=True)
class NewItem:
    """An item to append. `raw` is the exact JSON the API carried (the source of truth)."""

    item_id: str
    raw: JsonDict
    api: Literal["chat", "responses"]
    tokens: int = 0  # counted once, stored with the item, never recounted on rebuild
    encoding: str = ""  # "" when not counted: the reader counts it
    response_id: str | None = None  # the response this item was input to or output of
    role: Literal["input", "output"] = "input"
    digest: str = ""  # proxy.core.items.content_digest(raw); computed at write when ""


@dataclass(frozen=True)
class StoredItem:
    seq: int  # position in the thread's log, 0-based, strictly increasing
    item_id: str
    raw: JsonDict
    api: Literal["chat", "responses"]
    tokens: int
    encoding: str
    response_id: str | None
    role: Literal["input", "output"]
    created_at: str
    digest: str = ""  # content_digest(raw), stored beside `tokens`; "" when unknown


def stored_items(
    items: Sequence[NewItem], first_seq: int, now: str, response_id: str | None = None
) -> tuple[StoredItem, ...]:
    """`items` as the store keeps them from `first_seq` on; an item without a response id
    inherits the turn's, and one without a digest gets it computed here."""
    return tuple(
        StoredItem(
            first_seq + offset,
            item.item_id,
            item.raw,
            item.api,
            item.tokens,
            item.encoding,
            item.response_id or response_id,
            item.role,
            now,
            item.digest or content_digest(item.raw),
        )
        for offset, item in enumerate(items)
    )


@dataclass(frozen=True)
class Thread:
    tenant: str
    id: str
    kind: ThreadKind
    metadata: Mapping[str, str]
    created_at: str
    version: int  # bumped by every state write; the OCC token
    next_seq: int  # seq the next appended item gets
    state: JsonDict  # checkpoint: window start, summary items, compressed forms (SPEC 2)
    head_response_id: str | None = None  # last completed response on this thread
    epoch: int = 0  # bumped when an item leaves the log (delete_item); the version is not


@dataclass(frozen=True)
class Window:
    """What a rebuild reads: the thread and its items from the window start on."""

    thread: Thread
    items: tuple[StoredItem, ...]


def window_start(state: JsonDict) -> int:
    """First seq still sent verbatim (SPEC section 2, thread state)."""
    start = state.get("window_start", 0)
    return start if isinstance(start, int) and start > 0 else 0


@dataclass(frozen=True)
class ItemPage:
    items: tuple[StoredItem, ...]
    has_more: bool


@dataclass(frozen=True)
class StoredResponse:
    tenant: str
    id: str
    thread_id: str | None
    previous_response_id: str | None
    status: ResponseStatus
    request: JsonDict  # the client's request body (minus input items, which are in items)
    response: JsonDict | None  # the final Response object as returned to the client
    created_at: str
    owner: str  # process instance that ran it; crash recovery marks orphans incomplete
    input_first_seq: int | None = None  # seq range of this response's items in its thread
    output_last_seq: int | None = None
    background: bool = False  # `background: true`: run by its owner, cancellable


@dataclass(frozen=True)
class ResponseEvent:
    """One stored event of a background stream: `seq` is its `sequence_number` (0 up),
    `data` the event's JSON as the client gets it, `event` the SSE event name."""

    seq: int
    event: str | None
    data: str


@dataclass(frozen=True)
class LedgerEntry:
    tenant: str
    scope: str  # "tenant" or "thread:<id>"
    key: str  # rendered idempotency key
    tool: str
    call_id: str
    thread_id: str | None
    response_id: str | None
    status: LedgerStatus
    arguments: str
    result: str | None
    attempts: int
    created_at: str
    updated_at: str


@dataclass(frozen=True)
class ExplainRecord:
    """What one model request sent and why (proxy/server/explain.py)."""

    tenant: str
    request_id: str
    created_at: str
    record: JsonDict

    @property
    def thread_id(self) -> str | None:
        """The thread the request was on (the record's `thread_id`), if any."""
        thread_id = self.record.get("thread_id")
        return thread_id if isinstance(thread_id, str) else None


@dataclass(frozen=True)
class ExplainRow:
    """A record as its writer hands it to the store: `text` is its JSON, made once by the
    writer (proxy/server/explain.py) and kept as it is; read back as ExplainRecord."""

    tenant: str
    request_id: str
    created_at: str
    thread_id: str | None
    text: str


@dataclass(frozen=True)
class Heartbeat:
    """A process instance's last sign of life (replica-safe recovery, SPEC 7 and 8)."""

    owner: str  # the process instance, as in StoredResponse.owner
    host: str  # machine and pid namespace it runs in ("" when unknown): where `pid` means it
    pid: int
    started_at: str
    heartbeat_at: str


@dataclass(frozen=True)
class IdempotencyRecord:
    tenant: str
    key: str
    fingerprint: str
    status: Literal["running", "done"]
    response_status: int | None
    response_headers: Sequence[tuple[str, str]] = field(default_factory=tuple)
    response_body: bytes | None = None
    created_at: str = ""
    expires_at: str = ""
    # process instance running it; a `running` record of a dead owner is deleted by
    # abandon_dead / retire. "" (stored as NULL): unknown, never swept, left to expire.
    owner: str = ""


@dataclass(frozen=True)
class StoredSummary:
    """A summary an LLM wrote for one run of history items (a chunk), by its digest; or
    the deterministic digest a stateless request sent for the chunk first (state None),
    kept so that every process goes on sending it (proxy/server/summaries.py, claim)."""

    tenant: str
    model: str  # the tenant's summarizer model (the key), which wrote it unless claimed
    api: Literal["chat", "responses"]
    digest: str  # the chunk's digest (proxy/core/projection.py)
    raw: JsonDict  # the summary item as sent
    state: JsonDict | None  # the structured memory state it was rendered from
    created_at: str


@dataclass(frozen=True)
class InspectorSession:
    """A signed-in inspector browser (proxy/server/inspector.py). The row is the session:
    deleting it signs the browser out on every worker and replica sharing the store."""

    id_hash: str  # sha256 of the id the cookie carries: the store alone signs nobody in
    tenant: str | None  # None: the operator
    key_hash: str | None  # the tenant key it signed in with (None for the operator)
    signing_key: str  # names the operator token it was signed under (not the token)
    created_at: str
    expires_at: str


@dataclass(frozen=True)
class LearnedRecord:
    """What the proxy learnt about one (tenant, upstream, model) (proxy/server/model_budget.py):
    `state` is its JSON form, which only that module reads and writes."""

    tenant: str
    upstream: str
    model: str
    state: JsonDict
    updated_at: str


MAX_SUMMARY_DIGESTS = 100  # digests one summaries_get reads at most
SummaryKey = tuple[str, str, str, str]  # (tenant, model, api, digest)


class StoreLifecycle(Protocol):
    """Opening, migrating and probing the store (the app's start, /readyz, the CLI)."""

    async def migrate(self) -> None:
        """Apply pending numbered migrations (under an advisory lock on PostgreSQL)."""

    async def close(self) -> None: ...

    async def ping(self) -> None:
        """Raise StoreUnavailable when the store cannot take a write now: it is
        unreachable, or a write failed for lack of space within the last
        FULL_REMEMBERED_SECONDS (readiness probe; /readyz also writes a heartbeat)."""


class ThreadStore(Protocol):
    """Threads and their items: the event log, its checkpoint state, and the one
    write of a turn (`commit_turn`: items, state and the response's completion at once)."""

    async def create_thread(
        self,
        tenant: str,
        thread_id: str,
        *,
        kind: ThreadKind,
        metadata: Mapping[str, str] | None = None,
        items: Sequence[NewItem] = (),
        now: str,
    ) -> Thread:
        """Create a thread with optional initial items, atomically. AlreadyExists if taken."""

    async def get_thread(self, tenant: str, thread_id: str) -> Thread | None: ...

    async def list_threads(
        self, tenant: str | None, *, limit: int, callers: bool = False
    ) -> tuple[Thread, ...]:
        """Newest first; every tenant's when `tenant` is None (operators only). With
        `callers`, also those of the tenant's passthrough callers (`<tenant>:<hash>`)."""
        ...

    async def namespaces(self, tenant: str, *, limit: int) -> tuple[str, ...]:
        """The tenant's own namespace and its passthrough callers' (`<tenant>:<hash>`) that
        hold a thread or a stored response (operators only)."""
        ...

    async def find_threads(self, thread_id: str, *, limit: int = 10) -> tuple[Thread, ...]:
        """The threads with this id in any tenant (operators only: ids are per tenant)."""
        ...

    async def update_metadata(
        self, tenant: str, thread_id: str, metadata: Mapping[str, str]
    ) -> Thread | None: ...

    async def delete_thread(self, tenant: str, thread_id: str) -> bool:
        """Delete the thread and its items (an explicit DELETE is the only data removal),
        its explain records, and the LLM summaries kept for it that no other thread of the
        tenant keeps. Its stored responses, idempotency records and ledger entries stay
        (as OpenAI keeps a deleted conversation's responses): their retentions, or
        erase_thread, remove them."""

    async def erase_thread(self, tenant: str, thread_id: str) -> dict[str, int]:
        """Delete the thread and everything derived from it, in one transaction: its
        items, the LLM summaries no other thread keeps, its explain records, the responses
        and idempotency records of requests on it, and its ledger entries (either scope:
        a side effect it issued is forgotten, so a tenant-scoped key can be issued
        again). Works on a thread delete_thread already removed (what that left). How
        many rows went, per table ("threads": 0 when the thread row was gone already)."""
        ...

    async def fork_thread(
        self, tenant: str, source_id: str, new_id: str, *, through_seq: int, now: str
    ) -> Thread:
        """A new thread holding copies of the source's items with seq <= through_seq.
        Writes to either thread never touch the other. NotFound if the source is absent."""

    async def append_items(
        self,
        tenant: str,
        thread_id: str,
        items: Sequence[NewItem],
        *,
        expected_version: int | None = None,
        state: JsonDict | None = None,
        now: str,
    ) -> Thread:
        """Append items (and optionally replace the state) in one transaction, bumping the
        version. With expected_version, VersionConflict if the thread moved on. NotFound
        if the thread does not exist. Returns the updated thread."""

    async def commit_turn(
        self,
        tenant: str,
        thread_id: str,
        *,
        expected_version: int,
        items: Sequence[NewItem],
        state: JsonDict,
        now: str,
        response_id: str | None = None,
        response: JsonDict | None = None,
    ) -> Thread:
        """One transaction: append the turn's input + output items, replace the state,
        bump the version and (when response_id is given) mark that response completed
        with its final object, seq range and the thread's head. VersionConflict leaves
        everything untouched; so does a response cancelled meanwhile (Cancelled)."""

    async def load_window(self, tenant: str, thread_id: str, *, from_seq: int = 0) -> Window | None:
        """The thread plus its items with seq >= state["window_start"] (0 when absent)
        and >= from_seq, in seq order, read in one snapshot. Cost follows the live window,
        not the whole history; with from_seq (a window held in memory up to there), only
        what is new."""

    async def list_items(
        self,
        tenant: str,
        thread_id: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> ItemPage:
        """Conversation items paginated like OpenAI's list endpoints. `after` is an item id;
        NotFound if it is not in the thread."""

    async def items_between(
        self, tenant: str, thread_id: str, first_seq: int, last_seq: int
    ) -> tuple[StoredItem, ...]: ...

    async def get_item(self, tenant: str, thread_id: str, item_id: str) -> StoredItem | None: ...

    async def find_item(self, tenant: str, item_id: str) -> StoredItem | None:
        """The tenant's item with this id in any of its threads (what an `item_reference`
        names); a fork shares its source's items, and any copy is the same item."""

    async def delete_item(self, tenant: str, thread_id: str, item_id: str) -> bool:
        """Remove one item; the thread's `epoch` and version go up (a turn that read the
        thread before commits again, VersionConflict) and its cut goes (the thread is
        projected again from its log), with the thread's explain records. The LLM
        summaries kept for the thread stop being kept for it (they may quote the item):
        those no other thread keeps are deleted."""


class ResponseStore(Protocol):
    """Stored responses (`previous_response_id`, GET/DELETE /v1/responses/{id})."""

    async def begin_response(
        self, response: StoredResponse, *, max_running: int | None = None
    ) -> None:
        """Record a response `in_progress` before the provider is called. With
        `max_running`, a background response is recorded only while fewer than that many
        of the tenant's are `in_progress`, counted and inserted as one unit (concurrent
        calls, on any replica, never exceed it); TooManyRunning otherwise."""

    async def finish_response(
        self,
        tenant: str,
        response_id: str,
        *,
        status: ResponseStatus,
        response: JsonDict | None,
    ) -> None:
        """Mark a response incomplete/failed/cancelled (no items are added), or completed
        for responses that touch no thread (store without conversation). A cancelled
        response stays cancelled (this changes nothing); NotFound when there is none."""

    async def get_response(self, tenant: str, response_id: str) -> StoredResponse | None: ...

    async def find_responses(
        self, response_id: str, *, limit: int = 10
    ) -> tuple[StoredResponse, ...]:
        """The responses with this id in any tenant (operators only: ids are per tenant)."""
        ...

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        """The response and its stored events."""
        ...

    async def responses_purge(self, before: str, *, limit: int = 1000) -> int:
        """Delete at most `limit` of the oldest finished responses created before
        `before` (one transaction; the caller repeats while it gets `limit`), and the
        response chains (threads of kind "responses") left without a response, which no
        request can reach any more, as delete_thread deletes them. How many responses."""
        ...


class BackgroundStore(Protocol):
    """Background responses (proxy/server/background.py): cancellation and their
    stored stream events."""

    async def cancel_response(self, tenant: str, response_id: str) -> bool:
        """Conditional update: a background response still `in_progress` becomes
        `cancelled`. True if it did; of a cancel and a commit_turn/finish_response racing,
        exactly one takes effect, on every replica."""

    async def background_running(self, tenant: str) -> int:
        """How many of the tenant's background responses are `in_progress`."""

    async def response_events_append(
        self, tenant: str, response_id: str, events: Sequence[ResponseEvent], now: str
    ) -> None:
        """Keep a background stream's next events (a seq already kept is not replaced)."""

    async def response_events(
        self, tenant: str, response_id: str, *, after: int, limit: int
    ) -> tuple[ResponseEvent, ...]:
        """The stored events with seq > `after`, in order, at most `limit`."""

    async def response_events_last(self, tenant: str, response_id: str) -> int | None:
        """The highest stored seq of the response's events (None: none kept)."""

    async def response_events_purge(self, before: str) -> int:
        """Delete the events kept before `before` (their retention); returns how many."""


class HeartbeatStore(Protocol):
    """Process owners (replica-safe recovery, SPEC sections 7 and 8)."""

    async def heartbeat(self, owner: str, now: str, *, host: str = "", pid: int = 0) -> None:
        """Record that process instance `owner` is alive at `now` (upsert; `host` and
        `pid` are kept from the first beat and let a process on the same host tell at
        once whether `owner` is dead)."""

    async def heartbeats(self) -> tuple[Heartbeat, ...]:
        """The last heartbeat of every owner not yet retired or swept."""

    async def abandon_dead(self, stale_before: str, *, except_owner: str) -> int:
        """Responses `in_progress` whose owner has no heartbeat at or after `stale_before`
        (a dead process: they can never complete) become `incomplete`, in every tenant;
        its `running` idempotency records are deleted (the key runs again on retry) and
        the stale owner rows go too, in one transaction. `except_owner` (the caller) is
        never touched. Returns how many responses. Example, every replica every few seconds::

            await store.heartbeat(me, now)
            await store.abandon_dead(now_minus_30s, except_owner=me)
        """

    async def retire(self, owner: str) -> int:
        """Clean shutdown: `owner`'s leftover `in_progress` responses become `incomplete`,
        its `running` idempotency records are deleted and its owner row goes, in one
        transaction. Returns how many responses."""


class LedgerStore(Protocol):
    """The side-effect ledger (SPEC 6): one entry per rendered idempotency key."""

    async def ledger_issue(self, entry: LedgerEntry) -> tuple[LedgerEntry, bool]:
        """Insert the entry unless (tenant, scope, key) exists: first write wins.
        Returns (the entry now stored, True if this call created it)."""

    async def ledger_get(self, tenant: str, scope: str, key: str) -> LedgerEntry | None: ...

    async def ledger_by_call(self, tenant: str, call_id: str) -> LedgerEntry | None: ...

    async def ledger_resolve(
        self,
        tenant: str,
        scope: str,
        key: str,
        *,
        status: LedgerStatus,
        result: str | None,
        now: str,
        only_if: LedgerStatus = "issued",
    ) -> bool:
        """Conditional update: only an entry still in `only_if` changes. True if it did."""

    async def ledger_rearm(
        self, tenant: str, scope: str, key: str, *, call_id: str, now: str
    ) -> bool:
        """Conditional update failed -> issued for a new call: `call_id` replaces the old
        one, the result is cleared, attempts + 1. True if this call won (SPEC 6)."""

    async def ledger_list(
        self,
        tenant: str | None,
        *,
        status: LedgerStatus | None = None,
        limit: int = 100,
        callers: bool = False,
    ) -> tuple[LedgerEntry, ...]:
        """Oldest first; every tenant's when `tenant` is None (operators only). With
        `callers`, also those of the tenant's passthrough callers (`<tenant>:<hash>`)."""
        ...


class IdempotencyStore(Protocol):
    """Request idempotency records (the Idempotency-Key header)."""

    async def idempotency_begin(self, record: IdempotencyRecord) -> IdempotencyRecord | None:
        """Insert a `running` record unless one exists for (tenant, key) and is not
        expired; return the existing one (None when this call inserted)."""

    async def idempotency_finish(
        self,
        tenant: str,
        key: str,
        *,
        status: int,
        headers: Sequence[tuple[str, str]],
        body: bytes,
        thread_id: str | None = None,
    ) -> None:
        """Store the answer to replay; `thread_id` is the thread the request ran on,
        whose erase_thread deletes the record."""

    async def idempotency_abort(self, tenant: str, key: str) -> None:
        """Forget a running record (its response is not stored, e.g. a provider 5xx)."""

    async def idempotency_purge(self, now: str) -> int:
        """Delete expired records. Returns how many."""


class SummaryStore(Protocol):
    """LLM summaries, by chunk digest (proxy/server/summaries.py)."""

    async def summary_put(self, summary: StoredSummary, *, thread_id: str | None = None) -> bool:
        """Stores a summary; the first write of a (tenant, model, api, digest) wins and
        a later one returns False, changing nothing else. With `thread_id`, the summary
        (new or already stored) is also kept for that thread of the tenant, and deleted
        with the last thread it is kept for (delete_thread); when the thread does not
        exist (deleted meanwhile), nothing is written and the answer is False. Without,
        only the retention (summaries_purge) removes it."""
        ...

    async def summaries_get(
        self, tenant: str, model: str, api: str, digests: Sequence[str]
    ) -> dict[str, StoredSummary]:
        """The stored summaries among `digests` (at most MAX_SUMMARY_DIGESTS), by digest."""
        ...

    async def summaries_keep(
        self, tenant: str, thread_id: str, model: str, api: str, digests: Sequence[str]
    ) -> None:
        """The stored summaries among `digests` (at most MAX_SUMMARY_DIGESTS) are kept
        for this thread too, as summary_put with `thread_id` keeps a new one (nothing
        happens when the thread does not exist)."""

    async def summaries_touch(self, keys: Sequence[SummaryKey], now: str) -> None:
        """Marks these summaries used at `now` (a batch of what a process served from
        memory since its last batch); keys no longer stored are skipped."""

    async def summaries_purge(self, before: str) -> int:
        """Deletes the summaries last used before `before`, and those whose threads are
        all deleted; how many went."""


class ExplainStore(Protocol):
    """Explain records: what one model request sent and why."""

    async def explain_put(self, rows: Sequence[ExplainRow]) -> None:
        """Insert in one transaction; a request id already kept stays as it is."""

    async def explain_get(self, tenant: str | None, request_id: str) -> ExplainRecord | None:
        """The tenant's record; with tenant None (operators), the one record with this id."""

    async def explain_for_thread(
        self, tenant: str, thread_id: str, *, limit: int
    ) -> tuple[ExplainRecord, ...]:
        """The thread's most recent records, newest first (the inspector's thread page)."""
        ...

    async def explain_purge(self, before: str) -> int:
        """Delete the records created before `before`; how many went."""


class SecretStore(Protocol):
    """Server secrets (not tenant data: one value per name for every replica)."""

    async def secret(self, name: str) -> str | None:
        """The secret stored under `name`, or None."""

    async def create_secret(self, name: str, value: str, now: str) -> str:
        """Stores `value` under `name` unless a value is there already, and returns the
        stored one: replicas racing to create it all get the first write's value."""


class UpstreamApiStore(Protocol):
    """The API learnt for a tenant's upstream (policy upstream.api: auto)."""

    async def upstream_api_get(self, tenant: str, base_url: str) -> str | None:
        """The API learnt for this tenant's upstream at `base_url` ("chat"), or None."""

    async def upstream_api_set(self, tenant: str, base_url: str, api: str, now: str) -> str:
        """Records `api` for the upstream unless one is recorded already; returns the
        recorded one (the first write wins, as replicas may learn it together)."""


class InspectorSessionStore(Protocol):
    """Signed-in inspector browsers (proxy/server/inspector.py)."""

    async def inspector_session_create(self, session: InspectorSession) -> None:
        """Stores a new session (ids are random: AlreadyExists only on a reused id)."""

    async def inspector_session_get(self, id_hash: str) -> InspectorSession | None:
        """The session with this id hash, expired or not (the caller checks the time)."""

    async def inspector_session_revoke(self, id_hash: str) -> bool:
        """Deletes the session (sign-out); True if it existed."""

    async def inspector_sessions_purge(self, *, now: str, signing_key: str | None = None) -> int:
        """Deletes the sessions expired at `now` and, given `signing_key`, those signed
        under another key (the operator token was changed); how many went."""


class LearnedStore(Protocol):
    """What the proxy learnt per (tenant, upstream, model) (proxy/server/model_budget.py)."""

    async def learned_get(self, tenant: str, upstream: str, model: str) -> LearnedRecord | None:
        """What was learnt about the model on this tenant and upstream, if anything."""

    async def learned_put(self, record: LearnedRecord) -> None:
        """Writes the record (insert or replace: the last write wins)."""

    async def learned_list(
        self, tenant: str | None, *, limit: int = 1000
    ) -> tuple[LearnedRecord, ...]:
        """The records of `tenant` (None: every tenant), by tenant, upstream and model."""


class Store(
    StoreLifecycle,
    ThreadStore,
    ResponseStore,
    BackgroundStore,
    HeartbeatStore,
    LedgerStore,
    IdempotencyStore,
    SummaryStore,
    ExplainStore,
    SecretStore,
    UpstreamApiStore,
    InspectorSessionStore,
    LearnedStore,
    Protocol,
):
    """Async storage contract shared by the SQLite and PostgreSQL backends: the union of
    the concerns above. A consumer takes the narrow protocol of the concern it uses
    (`LedgerStore`, `SummaryStore`, ...); only what opens, runs or tests the whole store
    takes `Store`.

    Times are ISO-8601 strings passed in by the caller (the core has no clock). All
    methods are tenant-scoped. Methods returning `X | None` return None for a row that
    does not exist *for this tenant*.
    """
