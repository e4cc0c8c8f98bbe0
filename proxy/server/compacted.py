"""A compacted turn's answer (proxy/server/compaction.py decides; this shapes): the
provider's answer with the turn's compaction item first (`WithCompaction`), or a
Response the proxy serves itself in place of the provider's (`LocalAnswer`, a
compaction_trigger's)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core import events as ev
from proxy.core import fastjson
from proxy.core.items import JsonDict
from proxy.sse import SSEDecoder, encode_event
from proxy.upstream import UpstreamResponse


class WithCompaction:
    """The provider's answer with the turn's compaction item first in its `output`, as
    OpenAI returns it; a stream gets the item's output_item.added and .done events before
    the provider's first output event, and the provider's output indexes and sequence
    numbers move up to make room. Everything else is the provider's answer."""

    def __init__(self, upstream: UpstreamResponse, item: JsonDict) -> None:
        self._upstream = upstream
        self._item = item
        self._sent = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._upstream, name)

    async def aread(self) -> bytes:
        body = await self._upstream.aread()
        if self._upstream.status >= 400:
            return body
        try:
            answer = json.loads(body)
        except ValueError:
            return body  # the relay reports the provider's malformed answer
        if isinstance(answer, dict) and isinstance(answer.get("output"), list):
            answer["output"] = [self._item, *answer["output"]]
            return fastjson.dumps(answer)
        return body

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        decoder = SSEDecoder()
        async for chunk in self._upstream.aiter_bytes():
            frames = [self._frames(event.event, event.data) for event in decoder.feed(chunk)]
            yield b"".join(frame for group in frames for frame in group)
        for event in decoder.flush():
            yield b"".join(self._frames(event.event, event.data))

    def _frames(self, name: str | None, data: str) -> list[bytes]:
        try:
            payload = json.loads(data)
        except ValueError:
            return [encode_event(data, event=name)]
        if not isinstance(payload, dict):
            return [encode_event(data, event=name)]
        kind = payload.get("type", name)
        out = []
        if not self._sent and kind not in ev.SNAPSHOT_EVENTS:
            out.extend(self._item_events(payload.get("sequence_number")))
            self._sent = True
        out.append(encode_event(fastjson.dumps(self._moved(payload)).decode(), event=name))
        return out

    def _item_events(self, sequence: Any) -> list[bytes]:
        """The compaction item's added and done events, numbered from the provider's
        first output event's number when it has one."""
        pair = [ev.item_added(0, self._item), ev.item_done(0, self._item)]
        if isinstance(sequence, int):
            events = ev.Numbering(sequence).events(pair)
        else:
            events = [{"type": kind, **fields} for kind, fields in pair]
        return [encode_event(fastjson.dumps(e).decode(), event=e["type"]) for e in events]

    def _moved(self, payload: JsonDict) -> JsonDict:
        if not self._sent:
            return payload
        moved = dict(payload)
        if isinstance(moved.get("output_index"), int):
            moved["output_index"] += 1
        if isinstance(moved.get("sequence_number"), int):
            moved["sequence_number"] += 2
        response = moved.get("response")
        if isinstance(response, dict) and isinstance(response.get("output"), list):
            moved["response"] = {**response, "output": [self._item, *response["output"]]}
        return moved


class LocalAnswer:
    """A Response served by the proxy, read by the turn as the provider's answer would be
    (relay, keeper, usage): whole, or as OpenAI's event stream of it."""

    status = 200
    attempts = 1
    retries = 0

    def __init__(self, response: JsonDict, stream: bool) -> None:
        self._response = response
        self.is_event_stream = stream
        kind = "text/event-stream" if stream else "application/json"
        self.headers = [("Content-Type", kind)]
        self.provider_headers = CIMultiDictProxy(CIMultiDict(self.headers))
        self.closed = False

    async def aread(self) -> bytes:
        return fastjson.dumps(self._response)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        for event in ev.response_events(self._response):
            yield encode_event(fastjson.dumps(event).decode(), event=event["type"])

    async def aclose(self) -> None:
        self.closed = True
