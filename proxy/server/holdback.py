"""Relaying an answer whose side-effecting calls the ledger guards (SPEC 6).

The relay's transformer (relay.Transformer, chosen by proxy/server/turn.py) when the tenant's
policy names a side-effecting tool. Non-streamed answers go through ledger.settle whole. Streams flow
event by event as they arrive, except a guarded call's own events (Chat: the tool_call
deltas of its index; Responses: its output_item.added, argument deltas and done,
output_item.done): those are held until the call's arguments are complete and its
ledger entry is committed, then flushed (HAND_OUT) or dropped (withheld). When every call
of the answer was withheld, the turn continues upstream after the provider's stream ends
(not streamed) and the continuation reaches the client as events of the same stream, in
each API's shape. Client-facing indexes (`index`, `output_index`, `sequence_number`) are
renumbered so a dropped call leaves no gap the SDKs would trip on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from proxy.core import events as ev
from proxy.core import fastjson
from proxy.core.answers import BadAnswer
from proxy.core.continuation import Settled
from proxy.core.ledger import CallKind, ToolCall
from proxy.server.api import ApiShape
from proxy.server.errors import ApiError
from proxy.server.ledger import LedgerDecision, LedgerGuard, settle
from proxy.server.relay import EventTransformer, Keeper, Untranslatable, send_model
from proxy.server.state import TENANT_POLICY
from proxy.server.validate import JsonDict
from proxy.sse import DONE, ChatStreamAccumulator, SSEEvent, encode_event, encode_json_event
from proxy.upstream import UpstreamUnavailable

log = structlog.get_logger("threadkeeper.holdback")


@dataclass(frozen=True)
class Guarded:
    """What the relay needs besides the upstream answer: the guard, the request the
    provider got (a continuation extends it), the keeper of a stored turn."""

    request: web.Request
    api: ApiShape
    guard: LedgerGuard
    sent: JsonDict
    keeper: Keeper | None = None
    response_id: str | None = None

    async def ask(self, body: JsonDict) -> JsonDict | None:
        """One continuation round, not streamed; None when the provider fails it (the
        client then gets the last answer the model gave)."""
        raw = fastjson.dumps(body)
        try:
            policy = self.request[TENANT_POLICY]
            upstream = await send_model(self.request, policy, self.api, body, raw, stream=False)
            answer = _json_or_none(await upstream.aread())
        except (ApiError, UpstreamUnavailable, BadAnswer, Untranslatable) as exc:
            log.warning("ledger_continuation_failed", error=repr(exc))
            return None
        if upstream.status >= 400:
            log.warning("ledger_continuation_failed", status=upstream.status)
            return None
        try:
            return self.api.check_answer(answer)
        except BadAnswer as exc:
            log.warning("ledger_continuation_failed", problem=exc.problem)
            return None

    async def settle(self, answer: JsonDict, decisions: Sequence[LedgerDecision] | None) -> Settled:
        return await settle(
            self.guard,
            self.api,
            self.sent,
            answer,
            self.ask,
            response_id=self.response_id,
            judged=decisions,
        )

    async def keep(self, answer: JsonDict, log_items: Sequence[JsonDict] | None) -> JsonDict:
        """The answer as the client gets it, kept first on a stored turn."""
        if self.keeper is None:
            return answer
        answer = self.keeper.rewrite(answer)
        await self.keeper.keep(answer, log_items)
        return answer


class Holdback(EventTransformer):
    """The relay's transformer for a guarded answer: a whole answer is settled at once
    (ledger.settle); a stream is held back call by call (the subclasses, one per API)."""

    def __init__(self, guarded: Guarded) -> None:
        super().__init__(guarded.api)  # self.upstream: what the provider said
        self.guarded = guarded

    async def answer(self, answer: JsonDict) -> JsonDict:
        settled = await self.guarded.settle(answer, None)
        return await self.guarded.keep(settled.answer, settled.log if settled.withheld else None)


# -- Chat Completions ---------------------------------------------------------------------------

CHUNK_META = ("id", "object", "created", "model", "system_fingerprint", "service_tier")


class ChatHoldback(Holdback):
    """Choice 0's guarded tool_call deltas are held per index; an index is complete when
    the next index starts or the finish_reason comes (OpenAI streams calls in order)."""

    def __init__(self, guarded: Guarded) -> None:
        super().__init__(guarded)
        self.client = ChatStreamAccumulator()  # what the client got
        self.base: JsonDict = {"object": "chat.completion.chunk"}
        self.held: dict[int, list[JsonDict]] = {}
        self.client_index: dict[int, int] = {}
        self.current: int | None = None
        self.decisions: list[LedgerDecision] = []
        self.finish: JsonDict | None = None  # the finish choice, held while calls are withheld
        self.tail: list[JsonDict] = []  # chunks after a held finish (usage)
        self.done = False

    @property
    def withheld(self) -> list[LedgerDecision]:
        return [v for v in self.decisions if v.withheld]

    async def event(self, event: SSEEvent, payload: JsonDict | None) -> list[bytes]:
        if event.data == DONE:
            return await self._done()
        chunk = payload
        if chunk is None:
            return []
        self.base.update({k: chunk[k] for k in CHUNK_META if k in chunk})
        frames: list[bytes] = []
        choices: list[JsonDict] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                choices.append(choice)
                continue
            kept, flushed = await self._choice(choice)
            frames += flushed
            choices += [kept] if kept is not None else []
        if chunk.get("choices") and not choices:
            return frames
        out = {**chunk, "choices": choices}
        if self.finish is not None:
            self.tail.append(out)
            return frames
        return [*frames, self._emit(out)]

    async def _choice(self, choice: JsonDict) -> tuple[JsonDict | None, list[bytes]]:
        delta = choice.get("delta") or {}
        flushed: list[bytes] = []
        passed: list[JsonDict] = []
        for call in delta.get("tool_calls") or ():
            index = int(call.get("index", 0))
            if index != self.current:
                flushed += await self._close()
                self.current = index
                if self.guarded.guard.guarded((call.get("function") or {}).get("name")):
                    self.held[index] = []
                else:
                    self.client_index[index] = len(self.client_index)
            if index in self.held:
                self.held[index].append(call)
            else:
                passed.append({**call, "index": self.client_index[index]})
        if choice.get("finish_reason"):
            flushed += await self._close()
        rest = {k: v for k, v in delta.items() if k != "tool_calls"}
        if passed:
            rest["tool_calls"] = passed
        kept = {**choice, "delta": rest}
        if choice.get("finish_reason") and self.withheld:
            self.finish = kept
            return None, flushed
        if "tool_calls" in delta and not rest and not choice.get("finish_reason"):
            return None, flushed
        return kept, flushed

    async def _close(self) -> list[bytes]:
        """The current call is complete: judge it if it is held, then flush or drop."""
        index, self.current = self.current, None
        if index is None or index not in self.held:
            return []
        deltas = self.held.pop(index)
        call_id = next((d["id"] for d in deltas if d.get("id")), "")
        name = "".join((d.get("function") or {}).get("name") or "" for d in deltas)
        arguments = "".join((d.get("function") or {}).get("arguments") or "" for d in deltas)
        call = ToolCall(call_id, name, arguments, self.api.name, "function", index)
        judged = await self.guarded.guard.judge_call(call, self._response_id())
        self.decisions.append(judged)
        if judged.withheld:
            return []
        self.client_index[index] = len(self.client_index)
        whole = {
            "index": self.client_index[index],
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        return [self._emit(self._chunk({"tool_calls": [whole]}))]

    def _response_id(self) -> str | None:
        return self.guarded.response_id or self.base.get("id")

    def _chunk(self, delta: JsonDict, finish: str | None = None) -> JsonDict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self.base, "choices": [choice]}

    def _emit(self, chunk: JsonDict) -> bytes:
        self.client.feed(chunk)
        return encode_json_event(chunk)

    async def _done(self) -> list[bytes]:
        self.done = True
        frames = await self._close()
        if self.finish is not None:
            frames += await self._settle()
        if self.guarded.keeper is not None:
            result = self.client.result()
            if result["choices"] and all(c["finish_reason"] for c in result["choices"]):
                await self.guarded.keep(result, None)
        return [*frames, encode_event(DONE)]

    async def _settle(self) -> list[bytes]:
        """The withheld calls are answered; what the client gets instead of the finish."""
        assert self.finish is not None
        answer = {**self.upstream.result(), "id": self.base.get("id")}
        settled = await self.guarded.settle(answer, self.decisions)
        final = settled.answer
        frames: list[bytes] = []
        if settled.continued:
            frames += self._continuation(final)
        else:
            finish = dict(self.finish)
            if finish.get("finish_reason") == "tool_calls" and not self.client_index:
                finish["finish_reason"] = "stop"
            frames.append(self._emit({**self.base, "choices": [finish]}))
            frames += [self._emit(chunk) for chunk in self.tail]
        return frames

    def _continuation(self, final: JsonDict) -> list[bytes]:
        choice = (final.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        chunks: list[JsonDict] = []
        if message.get("content"):
            chunks.append(self._chunk({"content": message["content"]}))
        calls: list[JsonDict] = []
        for call in message.get("tool_calls") or ():
            calls.append({**call, "index": len(self.client_index) + len(calls)})
        if calls:
            chunks.append(self._chunk({"tool_calls": calls}))
        chunks.append(self._chunk({}, choice.get("finish_reason") or "stop"))
        if self.tail:  # the client asked for a usage chunk
            chunks.append({**self.base, "choices": [], "usage": final.get("usage")})
        return [self._emit(chunk) for chunk in chunks]

    async def end(self) -> list[bytes]:
        if self.done or self.finish is None:
            return []
        return await self._done()  # a server that never sent [DONE]


# -- Responses ----------------------------------------------------------------------------------

CALL_ITEMS: dict[str, CallKind] = {"function_call": "function", "custom_tool_call": "custom"}


class ResponsesHoldback(Holdback):
    """A guarded call item's events are held from output_item.added to output_item.done."""

    def __init__(self, guarded: Guarded) -> None:
        super().__init__(guarded)
        self.held: dict[int, list[tuple[str, JsonDict]]] = {}
        self.client_index: dict[int, int] = {}  # upstream output_index -> the client's
        self.allocated = 0  # output indexes the client has seen
        self.items: dict[int, JsonDict] = {}  # client index -> the finished item it got
        self.decisions: list[LedgerDecision] = []
        self.numbering = ev.Numbering()
        self.response_id: str | None = guarded.response_id

    async def event(self, event: SSEEvent, payload: JsonDict | None) -> list[bytes]:
        data = payload
        if data is None:
            return [encode_event(event.data, event.event)] if event.data else []
        kind = event.event or str(data.get("type", ""))
        if kind in ev.TERMINAL_EVENTS:
            return await self._terminal(kind, data)
        if kind in ev.SNAPSHOT_EVENTS and isinstance(data.get("response"), dict):
            self.response_id = self.response_id or data["response"].get("id")
            data = {**data, "response": self._rewrite(data["response"])}
        if "output_index" not in data:
            return [self._emit(kind, data)]
        index = int(data["output_index"])
        if kind == ev.ITEM_ADDED and self._guarded_item(data.get("item")):
            self.held[index] = [(kind, data)]
            return []
        if index in self.held:
            self.held[index].append((kind, data))
            return await self._close(index) if kind == ev.ITEM_DONE else []
        if index not in self.client_index:
            self.client_index[index] = self._allocate()
        data = {**data, "output_index": self.client_index[index]}
        if kind == ev.ITEM_DONE:
            self.items[self.client_index[index]] = data["item"]
        return [self._emit(kind, data)]

    def _guarded_item(self, item: Any) -> bool:
        return (
            isinstance(item, dict)
            and isinstance(item.get("type"), str)
            and item["type"] in CALL_ITEMS
            and self.guarded.guard.guarded(item.get("name"))
        )

    async def _close(self, index: int) -> list[bytes]:
        events = self.held.pop(index)
        item = events[-1][1]["item"]
        kind = CALL_ITEMS[item["type"]]
        arguments = item.get("arguments" if kind == "function" else "input") or ""
        call = ToolCall(item["call_id"], item["name"], arguments, self.api.name, kind, index)
        judged = await self.guarded.guard.judge_call(call, self.response_id)
        self.decisions.append(judged)
        if judged.withheld:
            return []
        client_index = self.client_index[index] = self._allocate()
        self.items[client_index] = item
        return [self._emit(k, {**d, "output_index": client_index}) for k, d in events]

    async def _terminal(self, kind: str, data: JsonDict) -> list[bytes]:
        final = data.get("response") if isinstance(data.get("response"), dict) else {}
        assert isinstance(final, dict)
        frames: list[bytes] = []
        log_items: list[JsonDict] | None = None
        withheld = {v.call.call_id for v in self.decisions if v.withheld}
        if withheld and kind == ev.COMPLETED:
            settled = await self.guarded.settle(final, self.decisions)
            log_items = settled.log
            if settled.continued:
                for item in settled.answer.get("output") or ():
                    frames += self._item_events(item)
                output = [self.items[i] for i in sorted(self.items)]
                final = {**settled.answer, "output": output}
            else:
                final = settled.answer
        elif withheld:
            final = self.api.stripped(final, withheld)
        final = await self.guarded.keep(final, log_items)
        return [*frames, self._emit(kind, {**data, "response": final})]

    def _item_events(self, item: JsonDict) -> list[bytes]:
        """A finished item as the events OpenAI streams for it (continuation output)."""
        index = self._allocate()
        self.items[index] = item
        return [self._emit(kind, data) for kind, data in ev.item_events(index, item)]

    def _allocate(self) -> int:
        self.allocated += 1
        return self.allocated - 1

    def _rewrite(self, response: JsonDict) -> JsonDict:
        keeper = self.guarded.keeper
        return keeper.rewrite(response) if keeper is not None else response

    def _emit(self, kind: str, data: JsonDict) -> bytes:
        return encode_json_event(self.numbering.event(kind, data), event=kind)


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


HOLDBACKS: dict[str, type[Holdback]] = {"chat": ChatHoldback, "responses": ResponsesHoldback}


def holdback(guarded: Guarded) -> Holdback:
    """The stream transformer that holds back guarded calls, for the guarded API."""
    return HOLDBACKS[guarded.api.name](guarded)
