"""Responses turns sent to a provider that only serves Chat Completions (issue 25).

`send_model` is the one place a model turn goes upstream (run_turn and the ledger's
continuations call it). For a Responses turn it reads the tenant's `upstream.api`:

- `responses`: the request goes to /responses as it is.
- `chat`: it is translated (proxy/core/chat_translate.py) and sent to /chat/completions,
  and the answer comes back as a `TranslatedResponse`: the provider's Chat answer read as
  the Response (or Responses event stream) OpenAI would have sent, so the relay, the
  ledger, the keeper and the thread see a native Responses answer.
- `auto` (default): /responses until the provider answers it 404 or 405; then the turn
  is sent again translated, and when Chat answers it (anything but 404/405 again: an
  unknown model is a 404 on both) `chat` is recorded in the store for this tenant's
  upstream URL, and read from there (once per process) for every later turn.

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
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDictProxy

from proxy.clock import utc_now
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
from proxy.policy import Policy
from proxy.server.api import RESPONSES, ApiShape
from proxy.server.errors import ApiError
from proxy.server.relay import send_upstream, upstream_base
from proxy.server.state import CHAT_CAP_FIELDS, LOG_FIELDS, STORE, UPSTREAM_APIS
from proxy.server.validate import JsonDict
from proxy.sse import DONE, SSEDecoder, SSEEvent, encode_json_event, event_payload
from proxy.store.base import UpstreamApiStore
from proxy.upstream import ProviderAnswerTooLarge, UpstreamResponse

CHAT_PATH = "/chat/completions"
NOT_SERVED = frozenset({404, 405})  # what a Chat-only server answers on /v1/responses
SPEC_CAP = "max_completion_tokens"


class Untranslatable(Exception):
    """A turn found Chat-only only after its /responses call (`auto`) that Chat cannot
    carry: `error` is the client's 400, `upstream` the refused call (the turn's hooks see
    it as a refusal, so nothing of the turn stays in the store)."""

    def __init__(self, error: ApiError, upstream: UpstreamResponse) -> None:
        super().__init__(error.message)
        self.error = error
        self.upstream = upstream


async def upstream_api(request: web.Request, policy: Policy) -> str:
    """`responses`, `chat`, or `auto` (nothing learnt yet) for this tenant's upstream."""
    if policy.upstream.api != "auto":
        return policy.upstream.api
    key = (policy.tenant, upstream_base(request, policy))
    known = request.app[UPSTREAM_APIS]
    if key not in known:
        store: UpstreamApiStore = request.app[STORE]
        known[key] = await store.upstream_api_get(*key)
    return known[key] or "auto"


async def learn_chat(request: web.Request, policy: Policy) -> None:
    key = (policy.tenant, upstream_base(request, policy))
    store: UpstreamApiStore = request.app[STORE]
    learnt = await store.upstream_api_set(*key, "chat", utc_now())
    request.app[UPSTREAM_APIS][key] = learnt


def cap_learner(request: web.Request, policy: Policy) -> Callable[[str], None]:
    """Records the output-cap field this tenant's Chat upstream takes (in memory)."""
    key = (policy.tenant, upstream_base(request, policy))

    def learn(field: str) -> None:
        request.app[CHAT_CAP_FIELDS][key] = field
        request[LOG_FIELDS]["chat_cap_field"] = field

    return learn


# The last translation of the request, by the body and the `input` it was made from: a
# stateless turn whose projection changed nothing sends the client's own body, translated
# already by check_translatable. A projection gives the body a new `input` list
# (ApiShape.with_items); the hooks' upstream_body only changes params Chat never gets.
TRANSLATION: web.RequestKey[tuple[JsonDict, Any, JsonDict]] = web.RequestKey("translation", tuple)


def translated(request: web.Request, policy: Policy, body: JsonDict) -> JsonDict:
    """The Chat request for `body` (a 400 naming what Chat cannot carry)."""
    done = request.get(TRANSLATION)
    if done is not None and done[0] is body and done[1] is body.get("input"):
        return done[2]
    key = (policy.tenant, upstream_base(request, policy))
    field = request.app[CHAT_CAP_FIELDS].get(key, SPEC_CAP)
    chat = chat_request(body, ids=new_id, max_tokens_field=field)
    request[TRANSLATION] = (body, body.get("input"), chat)
    return chat


async def check_translatable(request: web.Request, policy: Policy, body: JsonDict) -> None:
    """Before anything is stored or forwarded: a turn for a Chat-only upstream that Chat
    cannot carry (a hosted tool, say) is refused with a 400 naming the param."""
    if await upstream_api(request, policy) == "chat":
        translated(request, policy, body)


async def send_model(
    request: web.Request,
    policy: Policy,
    api: ApiShape,
    sent: JsonDict,
    raw: bytes,
    *,
    stream: bool,
) -> UpstreamResponse:
    """The model turn `sent` (its bytes `raw`) to the provider, in the API it serves."""
    chosen = await upstream_api(request, policy) if api is RESPONSES else "responses"
    if chosen == "chat":
        return await _send_chat(request, policy, sent, translated(request, policy, sent), stream)
    upstream = await send_upstream(
        request, policy, path=api.path, body=raw, stream=stream, route=api.route
    )
    if chosen == "responses" or upstream.status not in NOT_SERVED:
        return upstream
    if await _names_the_model(upstream, sent):
        return upstream
    try:
        chat = translated(request, policy, sent)
    except ApiError as exc:
        raise Untranslatable(exc, upstream) from None
    answer = await _send_chat(request, policy, sent, chat, stream)
    if answer.status in NOT_SERVED:  # not the endpoint: the model, say; nothing learnt
        await answer.aclose()
        request[LOG_FIELDS].pop("upstream_api", None)
        return upstream
    await upstream.aclose()
    await learn_chat(request, policy)
    return answer


async def _names_the_model(upstream: UpstreamResponse, sent: JsonDict) -> bool:
    """Whether a 404/405 is about the model, not the endpoint: OpenAI's `model_not_found`,
    or a body that names the requested model (Ollama's `model "x" not found`). A server
    without /responses answers its framework's not-found, which names no model."""
    try:
        body = await upstream.aread()
    except ProviderAnswerTooLarge:
        return False
    model = sent.get("model")
    named = isinstance(model, str) and len(model) >= 2 and model.encode() in body
    return named or b'"model_not_found"' in body


async def _send_chat(
    request: web.Request, policy: Policy, sent: JsonDict, chat: JsonDict, stream: bool
) -> TranslatedResponse:
    """The Chat request upstream; sent once more with the other output-cap field when the
    provider refuses the one it got (nothing has reached the client yet)."""
    request[LOG_FIELDS]["upstream_api"] = "chat"
    learn = cap_learner(request, policy)
    upstream = await _post_chat(request, policy, chat, stream)
    field = cap_field(chat)
    if field is not None and await _refuses(upstream, field):
        await upstream.aclose()
        learn(OTHER_CAP[field])
        chat = with_cap_field(chat, OTHER_CAP[field])
        upstream = await _post_chat(request, policy, chat, stream)
    return TranslatedResponse(upstream, sent, chat, learn)


async def _post_chat(
    request: web.Request, policy: Policy, chat: JsonDict, stream: bool
) -> UpstreamResponse:
    body = fastjson.dumps(chat)
    return await send_upstream(
        request, policy, path=CHAT_PATH, body=body, stream=stream, route=RESPONSES.route
    )


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
