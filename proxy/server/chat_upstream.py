"""Responses turns sent to a provider that only serves Chat Completions (issue 25): the
translation's I/O side.

Which API a turn goes to is decided where it is sent (proxy/server/relay.py,
`send_model`, after the tenant's `upstream.api`: `responses`, `chat`, or `auto`, which
moves to `chat` once /responses answered 404 or 405 and Chat did not). A turn sent as
Chat is translated here (proxy/core/chat_translate.py: `translated`, checked before
anything is stored by `relay.check_translatable`) and its answer comes back as a
`TranslatedResponse`: the provider's Chat answer read as the Response (or Responses
event stream) OpenAI would have sent, so the relay, the ledger, the keeper and the
thread see a native Responses answer. Nothing here sends by itself: `send_chat` is given
the relay's `post`.

The output cap goes as `max_completion_tokens`, the spec's field. When the provider's 400
says it does not take that field (or `max_tokens`), the turn is sent once more with the
other one before any byte reaches the client, and an answer longer than the cap it was
sent (Ollama drops `max_completion_tokens` without an error) moves later turns to
`max_tokens`. Either is remembered per tenant and upstream URL, in this process's memory
(a restart learns it again, at the cost of one refused call or one uncapped answer).

The request's log line (so its explain record) says `upstream_api: chat` when translated,
and `chat_cap_field` when the cap field was switched.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDictProxy

from proxy.core import fastjson
from proxy.core.answers import BadAnswer, check_chat_chunk, check_chat_completion
from proxy.core.chat_translate import (
    OTHER_CAP,
    ChatStream,
    cap_field,
    cap_ignored,
    chat_answer,
    chat_request,
    refuses_field,
    with_cap_field,
)
from proxy.ids import new_id
from proxy.server.state import CHAT_CAP_FIELDS, LOG_FIELDS
from proxy.server.validate import JsonDict
from proxy.sse import DONE, SSEDecoder, SSEEvent, encode_json_event, event_payload
from proxy.upstream import ProviderAnswerTooLarge, UpstreamResponse

CHAT_PATH = "/chat/completions"
SPEC_CAP = "max_completion_tokens"
Upstream = tuple[str, str]  # (tenant, upstream base URL): what is learnt is keyed by it
Post = Callable[[bytes], Awaitable[UpstreamResponse]]  # a Chat body to CHAT_PATH


def cap_learner(request: web.Request, key: Upstream) -> Callable[[str], None]:
    """Records the output-cap field this tenant's Chat upstream takes (in memory)."""

    def learn(field: str) -> None:
        request.app[CHAT_CAP_FIELDS][key] = field
        request[LOG_FIELDS]["chat_cap_field"] = field

    return learn


# The last translation of the request, by the body and the `input` it was made from: a
# stateless turn whose projection changed nothing sends the client's own body, translated
# already by check_translatable. A projection gives the body a new `input` list
# (ApiShape.with_items); the hooks' upstream_body only changes params Chat never gets.
TRANSLATION: web.RequestKey[tuple[JsonDict, Any, JsonDict]] = web.RequestKey("translation", tuple)


def translated(request: web.Request, key: Upstream, body: JsonDict) -> JsonDict:
    """The Chat request for `body` (a 400 naming what Chat cannot carry)."""
    done = request.get(TRANSLATION)
    if done is not None and done[0] is body and done[1] is body.get("input"):
        return done[2]
    field = request.app[CHAT_CAP_FIELDS].get(key, SPEC_CAP)
    chat = chat_request(body, ids=new_id, max_tokens_field=field)
    request[TRANSLATION] = (body, body.get("input"), chat)
    return chat


async def send_chat(
    request: web.Request, key: Upstream, sent: JsonDict, chat: JsonDict, post: Post
) -> TranslatedResponse:
    """The Chat request upstream (`post` sends a body to CHAT_PATH); sent once more with
    the other output-cap field when the provider refuses the one it got (nothing has
    reached the client yet)."""
    request[LOG_FIELDS]["upstream_api"] = "chat"
    learn = cap_learner(request, key)
    upstream = await post(fastjson.dumps(chat))
    field = cap_field(chat)
    if field is not None and await _refuses(upstream, field):
        await upstream.aclose()
        learn(OTHER_CAP[field])
        chat = with_cap_field(chat, OTHER_CAP[field])
        upstream = await post(fastjson.dumps(chat))
    return TranslatedResponse(upstream, sent, chat, learn)


async def _refuses(upstream: UpstreamResponse, field: str) -> bool:
    if upstream.status not in (400, 422):
        return False
    try:
        body = await upstream.aread()
    except ProviderAnswerTooLarge:
        return False
    return refuses_field(upstream.status, body, field)


class TranslatedResponse(UpstreamResponse):
    """A Chat answer read as a Responses one. Error answers pass as they came (the relay
    puts them in OpenAI's envelope, the same for both APIs); a successful body is checked
    as a chat.completion (BadAnswer: the relay's 502) and translated; a stream is decoded
    and re-encoded event by event, as it arrives. An answer past the cap `chat` set for
    it tells `learn` to send `max_tokens` from now on."""

    def __init__(
        self,
        inner: UpstreamResponse,
        sent: JsonDict,
        chat: JsonDict,
        learn: Callable[[str], None],
    ) -> None:
        # Not UpstreamResponse.__init__: every read goes to `inner`.
        self.inner = inner
        self.sent = sent
        self.chat = chat
        self.learn = learn
        self.status = inner.status
        self.headers = inner.headers
        self.attempts = inner.attempts
        self.response_id = new_id("resp")
        self._translated: bytes | None = None

    @property
    def provider_headers(self) -> CIMultiDictProxy[str]:
        return self.inner.provider_headers

    @property
    def closed(self) -> bool:
        return self.inner.closed

    @property
    def is_event_stream(self) -> bool:
        return self.inner.is_event_stream

    async def aread(self) -> bytes:
        body = await self.inner.aread()
        if self.status >= 400:
            return body
        if self._translated is None:
            completion = check_chat_completion(_json(body))
            answer = chat_answer(self.sent, completion, response_id=self.response_id, ids=new_id)
            self._check_cap(answer.get("usage"))
            self._translated = fastjson.dumps(answer)
        return self._translated

    def _check_cap(self, usage: JsonDict | None) -> None:
        if cap_ignored(self.chat, usage):
            self.learn("max_tokens")

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        if not self.is_event_stream or self.status >= 400:
            yield await self.aread()
            return
        stream = ChatStream(self.sent, response_id=self.response_id, ids=new_id)
        decoder = SSEDecoder()
        async for chunk in self.inner.aiter_bytes():
            if frames := _frames(stream, decoder.feed(chunk)):
                yield frames
        if frames := _frames(stream, decoder.flush()) + _encoded(stream.done()):
            yield frames
        self._check_cap(stream.usage)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _frames(stream: ChatStream, events: list[SSEEvent]) -> bytes:
    out: list[JsonDict] = []
    for event in events:
        payload = event_payload(event)  # BadAnswer when the data is not JSON
        if payload is not None:
            out += stream.chunk(check_chat_chunk(payload))
        elif event.data == DONE:
            out += stream.done()
    return _encoded(out)


def _encoded(events: list[JsonDict]) -> bytes:
    return b"".join(encode_json_event(event, event=event["type"]) for event in events)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)  # faster than fastjson's on a Chat answer's size
    except (ValueError, RecursionError):
        raise BadAnswer("it is not JSON") from None
