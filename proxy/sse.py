"""Server-sent events: a pure decoder, an encoder, and stream accumulators (SPEC section 1).

The proxy relays provider bytes to the client untouched and, on the side, feeds the same
bytes to an `SSEDecoder`; the decoded events go to an accumulator that rebuilds the final
object the non-streaming API would have returned, so a streamed turn is stored exactly
like a non-streamed one. Nothing here does I/O.

>>> decoder = SSEDecoder()
>>> decoder.feed(b'data: {"a": 1}\\n\\nda')
[SSEEvent(event=None, data='{"a": 1}', id=None, retry=None)]
>>> decoder.feed(b"ta: [DONE]\\n\\n")
[SSEEvent(event=None, data='[DONE]', id=None, retry=None)]
"""

from __future__ import annotations

import codecs
import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from proxy.core import fastjson
from proxy.core.answers import BadAnswer, check_chat_chunk, check_response_event
from proxy.core.events import (
    COMPLETED,
    ERROR,
    FAILED,
    INCOMPLETE,
    ITEM_ADDED,
    ITEM_DELTAS,
    ITEM_DONE,
    ITEM_DONES,
    PART_DELTAS,
    PART_DONES,
    PART_EVENTS,
    SNAPSHOT_EVENTS,
    TERMINAL_EVENTS,
)
from proxy.core.items import JsonDict

DONE = "[DONE]"


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class SSEEvent:
    event: str | None
    data: str
    id: str | None = None
    retry: int | None = None

    def json(self) -> Any:
        """The data parsed as JSON, or None for the `[DONE]` sentinel."""
        return None if self.data == DONE else json.loads(self.data)


class SSEDecoder:
    """Incremental decoder following the WHATWG "event stream interpretation" rules.

    Lines may end in LF, CRLF or CR, even with the CR and LF in different chunks, and a
    UTF-8 sequence may be split across chunks. One deliberate leniency: `flush()`
    dispatches an event whose final blank line never came, because some
    OpenAI-compatible servers end the stream right after `data: [DONE]\\n`.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []  # text of the current, unterminated line, as received
        self._after_cr = False  # last char seen was CR: a following LF is the same break
        self._at_start = True  # a leading BOM is dropped once
        self._event: str | None = None
        self._data: list[str] = []
        self._last_id: str | None = None  # persists across events, per the spec
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        return self._feed_text(self._utf8.decode(chunk))

    def flush(self) -> list[SSEEvent]:
        """The events still pending at the end of the stream (see the class docstring)."""
        events = self._feed_text(self._utf8.decode(b"", final=True))
        if self._pieces:
            events.extend(self._process_line(self._take_line("")))
        events.extend(self._process_line(""))
        return events

    def _feed_text(self, text: str) -> list[SSEEvent]:
        if self._at_start and text:
            self._at_start = False
            text = text.removeprefix("\ufeff")
        if self._after_cr and text:
            self._after_cr = False
            text = text.removeprefix("\n")
        if not text:
            return []
        self._after_cr = text.endswith("\r")
        # Only the new text is scanned for line breaks, so a line arriving in many chunks
        # costs time linear in its length (a 20 MB `data:` line is one pass, not one per
        # chunk).
        first, *rest = _LINE_BREAK.split(text)
        if not rest:
            self._pieces.append(first)
            return []
        events = self._process_line(self._take_line(first))
        *complete, last = rest
        for line in complete:
            events.extend(self._process_line(line))
        if last:
            self._pieces.append(last)
        return events

    def _take_line(self, end: str) -> str:
        line = "".join([*self._pieces, end])
        self._pieces = []
        return line

    def _process_line(self, line: str) -> list[SSEEvent]:
        if not line:
            event = self._dispatch()
            return [event] if event is not None else []
        if line.startswith(":"):
            return []
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        self._apply_field(name, value)
        return []

    def _apply_field(self, name: str, value: str) -> None:
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            if "\0" not in value:
                self._last_id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self._retry = int(value)
        # Any other field name is ignored, as the spec says.

    def _dispatch(self) -> SSEEvent | None:
        event, data, retry = self._event, self._data, self._retry
        self._event, self._data, self._retry = None, [], None
        if not data:
            return None
        return SSEEvent(event=event or None, data="\n".join(data), id=self._last_id, retry=retry)


class EventTooLarge(ValueError):
    """One event of a framed stream grew above the framer's limit before it ended."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"an event is larger than {limit} bytes")
        self.limit = limit


class EventFramer:
    """Cuts a relayed byte stream at event boundaries, so a relay hands the client whole
    events only: a malformed or cut-off event is never half-sent, and an error event
    written after it stays a clean event of its own. An event ends at a blank line:
    "\\n\\n", "\\r\\r" or "\\n\\r" (CRLF pairs contain the last; the LF closing one goes
    with its event). The event being received is held, at most `limit` bytes of it
    (EventTooLarge above). Linear: each byte is searched once.

    >>> framer = EventFramer()
    >>> framer.feed(b"data: 1\\n\\ndata: ")
    b'data: 1\\n\\n'
    >>> framer.feed(b"2\\n\\n")
    b'data: 2\\n\\n'
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._held: list[bytes] = []
        self._size = 0
        self._last = b""  # the previous chunk's last byte: a boundary may straddle chunks

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of the events this chunk completes (possibly none)."""
        if not chunk:
            return b""
        window = self._last + chunk
        self._last = chunk[-1:]
        end = max(window.rfind(b"\n\n"), window.rfind(b"\r\r"), window.rfind(b"\n\r"))
        if end == -1:
            return self._hold(chunk)
        cut = end + 2 - (len(window) - len(chunk))
        if window[end + 1 : end + 2] == b"\r" and chunk[cut : cut + 1] == b"\n":
            cut += 1  # the LF of a closing CRLF goes with its event
        done = b"".join([*self._held, chunk[:cut]])
        self._held, self._size = [], 0
        self._hold(chunk[cut:])
        return done

    def _hold(self, data: bytes) -> bytes:
        if data:
            self._held.append(data)
            self._size += len(data)
        if self.limit is not None and self._size > self.limit:
            raise EventTooLarge(self.limit)
        return b""

    def rest(self) -> bytes:
        """What is left at the end of the stream (an event without its final blank line)."""
        held, self._held, self._size = b"".join(self._held), [], 0
        return held


def event_payload(event: SSEEvent) -> JsonDict | None:
    """The event's JSON object; None for `[DONE]` and empty data. Any other data is not
    what either API streams: BadAnswer."""
    if not event.data or event.data == DONE:
        return None
    try:
        payload = json.loads(event.data)  # faster than fastjson's on event-sized data
    except (ValueError, RecursionError):
        raise BadAnswer("a stream event's data is not JSON") from None
    if not isinstance(payload, dict):
        raise BadAnswer("a stream event's data is not a JSON object")
    return payload


def encode_event(data: str, event: str | None = None) -> bytes:
    """One SSE frame; multi-line data becomes several `data:` lines."""
    lines = [f"event: {event}"] if event is not None else []
    lines.extend(f"data: {line}" for line in _LINE_BREAK.split(data))
    return ("\n".join(lines) + "\n\n").encode("utf-8")


def encode_json_event(payload: Any, event: str | None = None) -> bytes:
    return encode_event(fastjson.dumps(payload).decode(), event)


# --- Chat Completions ---------------------------------------------------------------------


class _ChoiceState:
    def __init__(self, index: int) -> None:
        self.index = index
        self.role: str | None = None
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.has_content = False
        self.has_refusal = False
        self.tool_calls: dict[int, JsonDict] = {}
        self.function_call: JsonDict | None = None  # legacy single-function shape
        self.logprobs: JsonDict | None = None
        self.finish_reason: str | None = None

    def feed(self, choice: JsonDict) -> None:
        delta = choice.get("delta") or {}
        if delta.get("role"):
            self.role = delta["role"]
        if isinstance(delta.get("content"), str):
            self.has_content = True
            self.content.append(delta["content"])
        if isinstance(delta.get("refusal"), str):
            self.has_refusal = True
            self.refusal.append(delta["refusal"])
        for call in delta.get("tool_calls") or ():
            self._feed_tool_call(call)
        if isinstance(delta.get("function_call"), dict):
            self._feed_function_call(delta["function_call"])
        if choice.get("logprobs"):
            self._feed_logprobs(choice["logprobs"])
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def _feed_tool_call(self, delta: JsonDict) -> None:
        index = int(delta.get("index", len(self.tool_calls)))
        call = self.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        function = delta.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]

    def _feed_function_call(self, delta: JsonDict) -> None:
        if self.function_call is None:
            self.function_call = {"name": "", "arguments": ""}
        self.function_call["name"] += delta.get("name") or ""
        self.function_call["arguments"] += delta.get("arguments") or ""

    def _feed_logprobs(self, logprobs: JsonDict) -> None:
        if self.logprobs is None:
            self.logprobs = {}
        for key in ("content", "refusal"):
            if logprobs.get(key):
                self.logprobs.setdefault(key, []).extend(logprobs[key])

    def tool_call_list(self) -> list[JsonDict]:
        return [copy.deepcopy(self.tool_calls[i]) for i in sorted(self.tool_calls)]

    def message(self) -> JsonDict:
        message: JsonDict = {
            "role": self.role or "assistant",
            "content": "".join(self.content) if self.has_content else None,
            "refusal": "".join(self.refusal) if self.has_refusal else None,
        }
        if self.tool_calls:
            message["tool_calls"] = self.tool_call_list()
        if self.function_call is not None:
            message["function_call"] = dict(self.function_call)
        return message

    def result(self) -> JsonDict:
        return {
            "index": self.index,
            "message": self.message(),
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
        }


class ChatStreamAccumulator:
    """Rebuilds the `chat.completion` a non-streaming call would have returned.

    >>> acc = ChatStreamAccumulator()
    >>> acc.feed({"id": "c1", "model": "m", "created": 1,
    ...           "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]})
    >>> acc.result()["choices"][0]["message"]["content"]
    'Hi'
    """

    def __init__(self) -> None:
        self._meta: JsonDict = {}
        self._choices: dict[int, _ChoiceState] = {}
        self.usage: JsonDict | None = None
        self._done = False
        self._errored = False  # a chunk carried an `error` instead of choices

    def feed_event(self, event: SSEEvent) -> None:
        """One decoded event: a chunk, or the `[DONE]` sentinel. BadAnswer when it is
        neither (proxy/core/answers.py)."""
        payload = event_payload(event)
        if payload is not None:
            self.feed(payload)
        elif event.data == DONE:
            self._done = True

    @property
    def ended(self) -> bool:
        """Whether the stream said its last word: `[DONE]`, or an error chunk."""
        return self._done or self._errored

    @property
    def finished(self) -> bool:
        """Whether the stream was whole: every choice finished, then `[DONE]`."""
        choices = self._choices.values()
        return self._done and bool(choices) and all(c.finish_reason for c in choices)

    def feed(self, chunk: JsonDict) -> None:
        check_chat_chunk(chunk)
        if chunk.get("error") is not None:
            self._errored = True
        for key in ("id", "model", "created", "system_fingerprint", "service_tier"):
            if chunk.get(key) is not None:
                self._meta[key] = chunk[key]
        for choice in chunk.get("choices") or ():
            index = int(choice.get("index", 0))
            self._choices.setdefault(index, _ChoiceState(index)).feed(choice)
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def tool_calls(self, choice_index: int = 0) -> list[JsonDict]:
        choice = self._choices.get(choice_index)
        return choice.tool_call_list() if choice else []

    def result(self) -> JsonDict:
        result: JsonDict = {
            "id": self._meta.get("id"),
            "object": "chat.completion",
            "created": self._meta.get("created"),
            "model": self._meta.get("model"),
            "choices": [self._choices[i].result() for i in sorted(self._choices)],
            "usage": self.usage,
        }
        for key in ("system_fingerprint", "service_tier"):
            if key in self._meta:
                result[key] = self._meta[key]
        return result


# --- Responses ------------------------------------------------------------------------------


class ResponsesStreamAccumulator:
    """Rebuilds the final Response object from a Responses event stream.

    The terminal event (`response.completed` / `.incomplete` / `.failed`) carries the whole
    Response, which wins. When the stream is cut before it, `result()` assembles one from
    the last snapshot (`response.created` / `.in_progress`) and the finished output items.
    """

    def __init__(self) -> None:
        self._snapshot: JsonDict | None = None
        self._final: JsonDict | None = None
        self._error: JsonDict | None = None
        self._items: dict[int, JsonDict] = {}  # in progress, rebuilt from deltas
        self._done: dict[int, JsonDict] = {}  # from response.output_item.done
        self._terminal: str | None = None

    def feed_event(self, event: SSEEvent) -> None:
        """One decoded event (its name, else its `type`). BadAnswer when it is not one
        (proxy/core/answers.py)."""
        payload = event_payload(event)
        if payload is not None:
            self.feed(event.event or str(payload.get("type", "")), payload)

    @property
    def terminal(self) -> bool:
        """Whether a terminal event (`response.completed` / `.incomplete` / `.failed`) came."""
        return self._terminal is not None

    @property
    def ended(self) -> bool:
        """Whether the stream said its last word: a terminal event, or an error event."""
        return self._terminal is not None or self._error is not None

    @property
    def finished(self) -> bool:
        """Whether the stream was whole: it ended with `response.completed` or
        `.incomplete` (a `.failed` response or an error event is not a stored answer)."""
        return self._terminal in (COMPLETED, INCOMPLETE) and self._error is None

    def feed(self, event_type: str, data: JsonDict) -> None:
        check_response_event(event_type, data)
        if event_type in SNAPSHOT_EVENTS:
            self._snapshot = data.get("response") or self._snapshot
        elif event_type in TERMINAL_EVENTS:
            self._terminal = event_type
            self._final = data.get("response")
            if event_type == FAILED and self._final and self._final.get("error"):
                self._error = self._final["error"]
        elif event_type == ERROR:
            self._error = _error_from_event(data)
        elif event_type == ITEM_ADDED:
            self._items[int(data["output_index"])] = copy.deepcopy(data["item"])
        elif event_type == ITEM_DONE:
            index = int(data["output_index"])
            self._done[index] = self._items[index] = copy.deepcopy(data["item"])
        else:
            self._feed_delta(event_type, data)

    def _feed_delta(self, event_type: str, data: JsonDict) -> None:
        item = self._items.get(int(data.get("output_index", -1)))
        if item is None:
            return
        if event_type in PART_EVENTS:
            _set_part(item, int(data["content_index"]), copy.deepcopy(data["part"]))
        elif event_type in PART_DELTAS:
            kind, key = PART_DELTAS[event_type]
            part = _part(item, int(data["content_index"]), kind)
            part[key] = part.get(key, "") + data.get("delta", "")
        elif event_type in PART_DONES:
            kind, key = PART_DONES[event_type]
            _part(item, int(data["content_index"]), kind)[key] = data[key]
        elif event_type in ITEM_DELTAS:
            key = ITEM_DELTAS[event_type]
            item[key] = item.get(key, "") + data.get("delta", "")
        elif event_type in ITEM_DONES:
            key = ITEM_DONES[event_type]
            item[key] = data[key]

    def item(self, output_index: int) -> JsonDict | None:
        """The item at that index as far as the stream has built it (may be partial)."""
        item = self._items.get(output_index)
        return copy.deepcopy(item) if item is not None else None

    def output_items(self) -> list[JsonDict]:
        return [copy.deepcopy(self._done[i]) for i in sorted(self._done)]

    def result(self) -> JsonDict | None:
        if self._final is not None:
            return copy.deepcopy(self._final)
        if self._snapshot is None and not self._done:
            return None
        response: JsonDict = copy.deepcopy(self._snapshot or {"object": "response"})
        response["output"] = self.output_items()
        return response

    def usage(self) -> JsonDict | None:
        final = self._final or self._snapshot
        return final.get("usage") if final else None

    def error(self) -> JsonDict | None:
        return copy.deepcopy(self._error)


def _error_from_event(data: JsonDict) -> JsonDict:
    # OpenAI sends the fields at top level; some compatible servers nest them in "error".
    if isinstance(data.get("error"), dict):
        nested: JsonDict = data["error"]
        return {k: nested.get(k) for k in ("type", "code", "message", "param") if k in nested}
    return {k: data.get(k) for k in ("code", "message", "param") if k in data}


def _set_part(item: JsonDict, index: int, part: JsonDict) -> None:
    content = item.setdefault("content", [])
    while len(content) <= index:
        content.append({})
    content[index] = part


def _part(item: JsonDict, index: int, kind: str) -> JsonDict:
    content = item.setdefault("content", [])
    while len(content) <= index:
        content.append({})
    if not content[index]:
        content[index] = {"type": kind}
    part: JsonDict = content[index]
    return part


# --- Completeness -------------------------------------------------------------------------


def stream_finished(family: str, body: bytes) -> bool:
    """Whether a whole SSE body (as a client received it) is a finished answer of that
    API; a malformed one is not."""
    accumulator: ChatStreamAccumulator | ResponsesStreamAccumulator
    accumulator = ChatStreamAccumulator() if family == "chat" else ResponsesStreamAccumulator()
    decoder = SSEDecoder()
    try:
        for event in [*decoder.feed(body), *decoder.flush()]:
            accumulator.feed_event(event)
    except BadAnswer:
        return False
    return accumulator.finished
