"""The thread modes, one seam each (proxy/server/turn.py, `Mode`): how a turn's thread is
read before the turn (`load`) and its new items written with the answer (`commit`), in
one write, before the answer's end reaches the client (SPEC 7). A cut-off answer adds
nothing.

- `Stateless`: nothing is read or written; the history is the client's.
- `ChatThread`: Chat Completions with `X-Thread-Id`; the request's messages are
  reconciled with the thread (proxy/threads.py, new_chat_messages).
- `ResponseChain`: Responses with `previous_response_id`, or `store` not false (a new
  chain); `Conversation`: Responses with `conversation`. The response is recorded
  `in_progress` before the provider is called (`begin`) and finished `incomplete` when
  the turn ends without being kept (`finish`).

A stored mode's commit is reached through its keeper (`Kept`, relay.Keeper): `rewrite`
is the answer as the client sees it, `keep` commits it. A turn whose thread was deleted
(or erased) while the provider answered keeps nothing, its response row included: a
non-streamed client gets a 4xx naming what went, a stream ends with the relay's
`store_error` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from proxy.core.models import is_reasoning_model
from proxy.ids import new_id
from proxy.server.api import ApiShape
from proxy.server.errors import ApiError, invalid
from proxy.server.relay import Keeper
from proxy.server.state import CLOCK, LOG_FIELDS, NAMESPACE, OWNER, TENANT_POLICY, THREADS
from proxy.server.turn import Load, Projected, Restate, Turn, off_the_loop
from proxy.server.validate import JsonDict, duplicate_item, missing
from proxy.store.base import NewItem, NotFound, StoredResponse, TooManyRunning
from proxy.threads import Loaded, ThreadService, new_chat_messages, new_items

THREAD_HEADER = "X-Thread-Id"
# The provider's answers that say the request itself is wrong (a rate limit or an outage
# is not: that response stays, `incomplete`).
BAD_INPUT = frozenset({400, 404, 413, 422})
ENCRYPTED_REASONING = "reasoning.encrypted_content"


class Stateless:
    """A turn whose history is the client's alone: nothing read, nothing kept."""

    response_id: str | None = None
    committed = False

    async def load(self, api: ApiShape, body: JsonDict) -> Load:
        return Load(None, body.get(api.history))

    def provider_body(self, body: JsonDict) -> JsonDict:
        return body

    async def begin(self) -> None:
        return None

    def keeper(self, turn: Turn, projected: Projected, restate: Restate) -> Keeper | None:
        return None

    def provider_answered(self, status: int) -> None:
        return None

    async def finish(self) -> None:
        return None


@dataclass(frozen=True)
class Kept:
    """A stored turn's keeper (relay.Keeper): the mode's rewrite, and its commit of
    the turn's values."""

    mode: StoredTurn
    turn: Turn
    projected: Projected
    restate: Restate

    def rewrite(self, response: JsonDict) -> JsonDict:
        return self.mode.rewrite(response)

    async def keep(self, result: JsonDict, log: Sequence[JsonDict] | None = None) -> None:
        await self.mode.keep(self, result, log)


class StoredTurn(Stateless):
    """What the stored modes share: the thread service, and the commit's items and state."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.threads = request.app[THREADS]
        self.committed = False  # the turn's items were written to its thread

    def keeper(self, turn: Turn, projected: Projected, restate: Restate) -> Keeper | None:
        return Kept(self, turn, projected, restate)

    def rewrite(self, response: JsonDict) -> JsonDict:
        return response

    async def keep(
        self, kept: Kept, result: JsonDict, log: Sequence[JsonDict] | None = None
    ) -> None:
        raise NotImplementedError

    async def turn_items(
        self, kept: Kept, reply: Sequence[JsonDict], response_id: str | None = None
    ) -> list[NewItem]:
        """The turn's new items (input) and the reply (output), counted once here."""
        counter, api, new = kept.projected.counter, kept.turn.api, kept.projected.new.items
        return await off_the_loop(
            lambda: [
                *new_items(new, counter, role="input", response_id=response_id),
                *new_items(
                    [api.item(raw) for raw in reply],
                    counter,
                    role="output",
                    response_id=response_id,
                ),
            ],
            list(reply),
        )

    async def commit(
        self,
        kept: Kept,
        items: Sequence[NewItem],
        response_id: str | None = None,
        response: JsonDict | None = None,
    ) -> None:
        """The turn's items and state, written to its thread (created by this write when
        it is new)."""
        loaded = kept.projected.window.loaded
        assert loaded is not None
        await self.threads.commit(
            loaded,
            items,
            state=loaded.state_after(kept.projected.projection.cut),
            restate=kept.restate,
            response_id=response_id,
            response=response,
        )
        self.committed = True


class ChatThread(StoredTurn):
    """A threaded chat turn: the new messages and the reply commit together once the
    reply is complete."""

    def __init__(self, request: web.Request, thread_id: str) -> None:
        super().__init__(request)
        self.thread_id = thread_id

    async def load(self, api: ApiShape, body: JsonDict) -> Load:
        request, thread_id = self.request, self.thread_id
        request[LOG_FIELDS]["thread_id"] = thread_id
        loaded = await self.threads.load_or_new(request[NAMESPACE], thread_id, "chat")
        if loaded.kind != "chat":
            raise invalid(
                f"Thread '{thread_id}' holds Responses items and cannot be continued with "
                "Chat Completions.",
                param=THREAD_HEADER,
                code="invalid_value",
            )
        messages = body["messages"]
        new = new_chat_messages(loaded, messages)  # a suffix of the request's messages
        skipped = len(messages) - len(new)
        taken = await self.threads.first_taken_id(loaded, new)
        if taken is not None:
            raise duplicate_item(f"messages[{skipped + taken}].id", new[taken]["id"])
        return Load(loaded, new)

    async def keep(
        self, kept: Kept, result: JsonDict, log: Sequence[JsonDict] | None = None
    ) -> None:
        """Commits what the client saw; `log` (a ledger-continued turn's trajectory) is
        not kept on Chat threads (see proxy/server/ledger.py)."""
        reply = kept.turn.api.reply(result)
        if reply is None:
            return
        items = await self.turn_items(kept, reply)
        try:
            await self.commit(kept, items)
        except NotFound:
            if kept.turn.body.get("stream"):
                raise  # the headers are sent: the stream ends with its store_error event
            raise ApiError(
                409,
                f"Thread '{self.thread_id}' was deleted while this request ran; its answer "
                "was not kept.",
                param=THREAD_HEADER,
                code="thread_deleted",
            ) from None


@dataclass(frozen=True)
class Chain:
    """Where a stateful request reads and writes: the thread, and the ids it echoes."""

    loaded: Loaded
    conversation: str | None = None
    previous_response_id: str | None = None


def conversation_id(body: JsonDict) -> str | None:
    value = body.get("conversation")
    if isinstance(value, dict):
        inner = value.get("id")
        if not isinstance(inner, str) or not inner:
            raise missing("conversation.id")
        return inner
    return value


def conversation_not_found(conversation: str) -> ApiError:
    return ApiError(404, f"Conversation with id '{conversation}' not found.", param="conversation")


def previous_not_found(previous: str) -> ApiError:
    return ApiError(
        400,
        f"Previous response with id '{previous}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


async def resolve_chain(request: web.Request, threads: ThreadService, body: JsonDict) -> Chain:
    """The thread a Responses request reads: its conversation's, the chain its previous
    response ends, or a new chain's."""
    conversation = conversation_id(body)
    if conversation is not None:
        return await conversation_chain(request, threads, conversation)
    return await response_chain(request, threads, body.get("previous_response_id"))


async def conversation_chain(
    request: web.Request, threads: ThreadService, conversation: str
) -> Chain:
    loaded = await threads.load(request[NAMESPACE], conversation)
    if loaded is None or loaded.kind != "conversation":
        raise conversation_not_found(conversation)
    return Chain(loaded, conversation=conversation)


async def response_chain(
    request: web.Request, threads: ThreadService, previous: str | None
) -> Chain:
    tenant = request[NAMESPACE]
    if previous is None:
        return Chain(Loaded(tenant, new_id("thread"), "responses", None))
    return Chain(await _continued(threads, tenant, previous), previous_response_id=previous)


async def previous_response(
    threads: ThreadService, tenant: str, previous: str
) -> tuple[StoredResponse, Loaded]:
    """The one rule for `previous_response_id` (a turn's chain, responses/compact): a
    completed response of the tenant whose thread is still there, with that thread's
    window; anything else is OpenAI's 400 previous_response_not_found."""
    stored = await threads.store.get_response(tenant, previous)
    thread = None
    if stored is not None and stored.status == "completed" and stored.thread_id is not None:
        thread = await threads.load(tenant, stored.thread_id)
    if stored is None or thread is None or thread.thread is None:
        raise previous_not_found(previous)
    return stored, thread


def last_seq(stored: StoredResponse) -> int:
    """The thread's last seq a response's chain holds (its output's last item)."""
    return stored.output_last_seq if stored.output_last_seq is not None else -1


async def _continued(threads: ThreadService, tenant: str, previous: str) -> Loaded:
    """The chain a previous response ends: its own thread while it is the head, else a
    branch of it (a fork written with the turn) that later responses never see."""
    stored, thread = await previous_response(threads, tenant, previous)
    assert thread.thread is not None
    if thread.kind == "responses" and thread.thread.head_response_id == previous:
        return thread
    return await threads.branch(tenant, thread.thread_id, last_seq(stored))


class ResponseChain(StoredTurn):
    """One stateful response: recorded before forwarding, kept when it completes,
    marked incomplete otherwise. `store: false` reads the chain and writes nothing."""

    def __init__(self, request: web.Request, body: JsonDict, *, background: bool = False) -> None:
        super().__init__(request)
        self.body = body
        self.background = background  # its runner settles what the turn leaves unfinished
        self.chain: Chain | None = None
        self.tenant = request[NAMESPACE]
        self.id = new_id("resp")
        self.response_id = self.id
        self.persist = body.get("store") is not False
        self.kept = False
        self.refused = False  # the provider refused the request (4xx): nothing to keep
        self._begun: asyncio.Future[None] | None = None

    async def chain_of(self, body: JsonDict) -> Chain:
        return await response_chain(self.request, self.threads, body.get("previous_response_id"))

    async def load(self, api: ApiShape, body: JsonDict) -> Load:
        self.chain = chain = await self.chain_of(body)
        self.request[LOG_FIELDS]["thread_id"] = chain.loaded.thread_id
        given = body.get("input")
        raws = given if isinstance(given, list) else []
        taken = await self.threads.first_taken_id(chain.loaded, raws)
        if taken is not None:
            raise duplicate_item(f"input[{taken}].id", raws[taken]["id"])
        return Load(chain.loaded, body.get(api.history))

    def provider_body(self, body: JsonDict) -> JsonDict:
        """The stateless request the provider gets (SPEC 3)."""
        sent = {k: v for k, v in body.items() if k not in ("conversation", "previous_response_id")}
        sent["store"] = False
        if is_reasoning_model(body.get("model") or ""):
            # Reasoning items can only be replayed statelessly with their encrypted content.
            include = list(body.get("include") or [])
            if ENCRYPTED_REASONING not in include:
                include.append(ENCRYPTED_REASONING)
            sent["include"] = include
        return sent

    async def begin(self) -> None:
        """Records the response `in_progress`, shielded: a client that goes away while the
        row is written must not leave it behind unfinished (`finish` waits for it)."""
        if not self.persist:
            return
        self._begun = asyncio.ensure_future(self._record_begin())
        await asyncio.shield(self._begun)

    async def _record_begin(self) -> None:
        assert self.chain is not None
        limit = self.request[TENANT_POLICY].background.max_running if self.background else None
        try:
            await self._insert_begun(limit)
        except TooManyRunning as exc:
            raise ApiError(
                429,
                f"Too many background responses running for this tenant (at most "
                f"{exc.limit}, policy background.max_running); retry once one ends.",
                type="rate_limit_error",
                param="background",
                code="rate_limit_exceeded",
            ) from None

    async def _insert_begun(self, max_running: int | None) -> None:
        assert self.chain is not None
        await self.threads.store.begin_response(
            StoredResponse(
                tenant=self.tenant,
                id=self.id,
                thread_id=self.chain.loaded.thread_id,
                previous_response_id=self.chain.previous_response_id,
                status="in_progress",
                request={k: v for k, v in self.body.items() if k != "input"},
                response=None,
                created_at=self.request.app[CLOCK].iso(),
                owner=self.request.app[OWNER],
                background=self.background,
            ),
            max_running=max_running,
        )

    def rewrite(self, response: JsonDict) -> JsonDict:
        """The provider's Response as the client sees it: this proxy's id and chain."""
        assert self.chain is not None
        conversation = self.chain.conversation
        return {
            **response,
            "id": self.id,
            "previous_response_id": self.chain.previous_response_id,
            "conversation": {"id": conversation} if conversation is not None else None,
            "store": self.persist,
            "background": self.background,
        }

    async def keep(
        self, kept: Kept, result: JsonDict, log: Sequence[JsonDict] | None = None
    ) -> None:
        """Commits the turn; `log` replaces the response's output as the thread's items
        when the ledger continued the turn (withheld calls and their synthetic outputs)."""
        if not self.persist:
            self.kept = True
            return
        status = result.get("status") or "completed"
        if status != "completed":
            await self._finish(status, result)
            return
        logged = log if log is not None else kept.turn.api.reply(result) or ()
        items = await self.turn_items(kept, logged, self.id)
        try:
            await self.commit(kept, items, self.id, result)
        except NotFound:
            lost = await self._lost()
            if lost is None:
                raise
            raise lost from None
        self.kept = True

    async def _lost(self) -> ApiError | None:
        """The turn's thread (a conversation deleted meanwhile) or its own response row
        went while the provider answered: nothing of the turn is kept, its response row
        included (no `incomplete` orphan), and the client hears what went, as a request
        sent a moment later would. A stream has sent its headers: it ends with the
        relay's `store_error` event instead (None: the NotFound goes on)."""
        assert self.chain is not None
        store, thread_id = self.threads.store, self.chain.loaded.thread_id
        await asyncio.shield(store.delete_response(self.tenant, self.id))
        self.kept = True
        if self.body.get("stream"):
            return None
        if await store.get_thread(self.tenant, thread_id) is not None:
            return ApiError(404, f"Response with id '{self.id}' not found.")
        if self.chain.conversation is not None:
            return conversation_not_found(self.chain.conversation)
        if self.chain.previous_response_id is not None:
            return previous_not_found(self.chain.previous_response_id)
        return ApiError(404, f"Response with id '{self.id}' not found.")

    def provider_answered(self, status: int) -> None:
        self.refused = status in BAD_INPUT

    async def finish(self) -> None:
        """A response begun and never kept is marked incomplete; one the provider refused
        as bad input is removed (SPEC 1: a 4xx changes nothing in the store)."""
        if self._begun is None or self.kept:
            return
        try:
            await asyncio.shield(self._begun)  # the row must exist before it is finished
        except Exception:
            return  # it was never written: nothing to finish
        if self.background:
            return  # it ends `failed` with the error (proxy/server/background.py)
        if self.refused:
            await asyncio.shield(self.threads.store.delete_response(self.tenant, self.id))
            self.kept = True
            return
        await self._finish("incomplete", None)

    async def _finish(self, status: str, result: JsonDict | None) -> None:
        finished = self.threads.store.finish_response(
            self.tenant,
            self.id,
            status=status,  # type: ignore[arg-type]
            response=result,
        )
        await asyncio.shield(finished)
        self.kept = True


class Conversation(ResponseChain):
    """A Responses turn appended to its `conversation` (a thread of kind "conversation",
    proxy/server/conversations.py)."""

    async def chain_of(self, body: JsonDict) -> Chain:
        conversation = conversation_id(body)
        assert conversation is not None
        return await conversation_chain(self.request, self.threads, conversation)
