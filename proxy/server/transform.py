"""What a model answer becomes on its way to the client: the relay's transformers.

The relay loop (proxy/server/relay.py, `relay_stream`) decodes each event once and hands
it with its parsed data to the turn's `Transformer`: `Passthrough` (the bytes untouched),
`Keep` (a stored turn, kept through its `Keeper` before its end reaches the client) or
the ledger's holdback (proxy/server/holdback.py, an `EventTransformer`). A non-streamed
answer goes through `Transformer.answer` whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from proxy.core import fastjson
from proxy.server.api import ApiShape
from proxy.server.validate import JsonDict
from proxy.sse import SSEEvent, encode_event


class Transformer(Protocol):
    """What one stream becomes on its way to the client. The relay loop decodes each
    event once, feeds it (checked) to `upstream`, then hands it with its parsed data to
    `event`; `passed` gets each raw chunk after its events; `end` runs at the provider's
    EOF (after the decoder's flush). Each returns the bytes the client gets next. A
    transformer takes a non-streamed answer whole (`answer`)."""

    @property
    def upstream(self) -> Any:
        """The accumulator of what the provider streamed (ApiShape.accumulator)."""
        ...

    async def event(self, event: SSEEvent, payload: JsonDict | None) -> list[bytes]: ...

    def passed(self, chunk: bytes) -> bytes: ...

    async def end(self) -> list[bytes]: ...

    async def answer(self, answer: JsonDict) -> JsonDict:
        """A whole (non-streamed) answer as the client gets it; the same object when
        it is relayed as the provider sent it."""
        ...


class EventTransformer:
    """A transformer that writes events it builds itself (raw chunks are not passed)."""

    def __init__(self, api: ApiShape) -> None:
        self.api = api
        self.upstream = api.accumulator()

    async def event(self, event: SSEEvent, payload: JsonDict | None) -> list[bytes]:
        raise NotImplementedError

    def passed(self, chunk: bytes) -> bytes:
        return b""

    async def end(self) -> list[bytes]:
        return []

    async def answer(self, answer: JsonDict) -> JsonDict:
        return answer


class Passthrough:
    """The provider's bytes untouched, whole events at a time: a malformed event is never
    sent, and an error event after it is a clean event of its own. Without an API shape
    (a passthrough endpoint) the bytes go as they come, not decoded."""

    def __init__(self, api: ApiShape | None) -> None:
        self.upstream = api.accumulator() if api is not None else None

    async def event(self, event: SSEEvent, payload: JsonDict | None) -> list[bytes]:
        return []

    def passed(self, chunk: bytes) -> bytes:
        return chunk  # an event stream's chunks are whole events (UpstreamResponse)

    async def end(self) -> list[bytes]:
        return []

    async def answer(self, answer: JsonDict) -> JsonDict:
        return answer


class Keeper(Protocol):
    """A stateful turn's hooks into the relay (SPEC 7): the final answer is persisted
    before its terminal bytes reach the client, so the client's next request finds it."""

    def rewrite(self, response: dict[str, Any]) -> dict[str, Any]:
        """A provider Response / chat.completion object as the proxy returns it."""
        ...

    async def keep(
        self, result: dict[str, Any], log: Sequence[dict[str, Any]] | None = None
    ) -> None:
        """Persist the final (rewritten) answer; called at most once. `log` replaces the
        answer's output as the thread's items when the ledger continued the turn."""
        ...


class Keep(EventTransformer):
    """A stateful turn's stream: response objects rewritten by the keeper, and the answer
    kept before the event that ends it reaches the client."""

    def __init__(self, api: ApiShape, keeper: Keeper) -> None:
        super().__init__(api)
        self.keeper = keeper
        self.kept = False

    async def event(self, event: SSEEvent, payload: JsonDict | None) -> list[bytes]:
        final = self.api.final_answer(self.upstream, event)
        if final is not None and not self.kept:
            await self.keeper.keep(self.keeper.rewrite(final))
            self.kept = True
        data = event.data
        if payload is not None:
            rewritten = self.api.rewritten_payload(payload, self.keeper.rewrite)
            if rewritten is not None:
                data = fastjson.dumps(rewritten).decode()
        return [encode_event(data, event=event.event)]

    async def answer(self, answer: JsonDict) -> JsonDict:
        final = self.keeper.rewrite(answer)
        await self.keeper.keep(final)
        return final
