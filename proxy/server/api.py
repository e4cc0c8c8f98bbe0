"""Where Chat Completions and Responses differ: one adapter per API.

Everything the turn path does is the same for both APIs except the shapes: which body
field holds the history, how an answer names its calls, what a stream's events look like
and when a stream has said its last word. Those live here, behind `ApiShape`; the turn
path asks the adapter and never tests which API it serves. The choice is made once, when
a handler picks `CHAT` or `RESPONSES` (or `for_route` for a stored stream). What is not
a shape stays with its feature: Responses-only endpoints and items (conversations,
compaction, `item_reference`) read stored rows of their API by its `name`. This module
imports nothing of proxy/server that imports it (a leaf of the turn path).

>>> CHAT.usage_input_tokens({"usage": {"prompt_tokens": 7}})
7
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.core.answers import check_chat_completion, check_response
from proxy.core.items import (
    Api,
    Item,
    JsonDict,
    chat_item,
    items_from_chat,
    items_from_responses_input,
    responses_input_from_items,
    responses_item,
)
from proxy.core.ledger import CallKind, ToolCall, ToolRule, side_effect_calls
from proxy.core.tokens import ANY_MODEL
from proxy.server.errors import error_body
from proxy.sse import (
    DONE,
    ChatStreamAccumulator,
    ResponsesStreamAccumulator,
    SSEEvent,
    encode_event,
    stream_finished,
)

ARGUMENTS_FIELD: Mapping[CallKind, str] = {"function": "arguments", "custom": "input"}
# Fields of a Chat assistant reply that a later request may carry (the rest is response-only).
REPLY_FIELDS = ("role", "content", "refusal", "name", "tool_calls", "function_call")
# What a continuation adds to the context (a reply's `name` is left out, as the provider sent).
CONTINUED_FIELDS = ("role", "content", "refusal", "tool_calls", "function_call")
Rewrite = Callable[[JsonDict], JsonDict]


@dataclass(frozen=True)
class BudgetInputs:
    """What the budget reads from a request besides its history (SPEC 4)."""

    model: str
    tools: list[dict[str, Any]]
    requested_output: int | None
    instructions: str | None = None
    # False for Responses `truncation: "disabled"`: nothing may be trimmed (SPEC 1).
    truncate: bool = True


class ApiShape(ABC):
    """One API family's shapes. `name` is the family stored with items and ledger calls;
    `path` the provider path; `history` the request field holding the history (and the
    `param` of its errors)."""

    @property
    def route(self) -> str:
        """The route's name (proxy/server/app.py) and metrics label: the path, dotted."""
        return self.path.strip("/").replace("/", ".")

    def __init__(
        self, name: Api, path: str, history: str, *, usage_key: str, orphan_text: str
    ) -> None:
        self.name = name
        self.path = path
        self.history = history
        self.usage_key = usage_key  # the answer's `usage` field counting the prompt
        self.orphan_text = orphan_text  # the 400 for a tool output whose call is nowhere

    # -- requests ------------------------------------------------------------------------

    @abstractmethod
    def items(self, history: Any) -> list[Item]:
        """A request's history (its `history` field's value, or a part of it) as items."""

    @abstractmethod
    def with_items(self, body: JsonDict, items: Sequence[Item]) -> JsonDict:
        """`body` with its history replaced by `items` (in place; returned for chaining)."""

    @abstractmethod
    def item(self, raw: JsonDict) -> Item:
        """One history entry (a message or an item) as an Item."""

    @abstractmethod
    def budget_inputs(self, body: JsonDict) -> BudgetInputs: ...

    @abstractmethod
    def call_item(self, tool: str, call_id: str, arguments: str, kind: CallKind) -> Item:
        """A tool call as history, rebuilt from the ledger (restored calls)."""

    def orphan_message(self, call_id: str) -> str:
        return self.orphan_text.format(call_id=call_id)

    # -- answers -------------------------------------------------------------------------

    @abstractmethod
    def check_answer(self, answer: Any) -> JsonDict:
        """A whole answer, checked (proxy/core/answers.py); BadAnswer otherwise."""

    def usage_input_tokens(self, answer: Any) -> int | None:
        """The prompt tokens the provider reports in an answer (or its usage holder)."""
        usage = answer.get("usage") if isinstance(answer, dict) else None
        value = usage.get(self.usage_key) if isinstance(usage, dict) else None
        return value if isinstance(value, int) else None

    @abstractmethod
    def calls(self, answer: JsonDict, rules: Mapping[str, ToolRule]) -> list[ToolCall]:
        """The answer's side-effecting calls, in emitted order."""

    @abstractmethod
    def call_count(self, answer: JsonDict) -> int:
        """Every tool call of the answer, guarded or not."""

    @abstractmethod
    def stripped(self, answer: JsonDict, call_ids: set[str]) -> JsonDict:
        """The answer without the withheld calls (the client never receives them)."""

    @abstractmethod
    def answer_items(self, answer: JsonDict) -> list[JsonDict]:
        """What the answer adds to the context of a continued request."""

    @abstractmethod
    def continued_body(self, sent: JsonDict, added: Sequence[JsonDict]) -> JsonDict:
        """The next provider request of the turn: the sent context plus `added`, not
        streamed."""

    @abstractmethod
    def finished(self, answer: JsonDict) -> bool:
        """Whether the answer is complete (a continuation may follow it)."""

    @abstractmethod
    def reply(self, answer: JsonDict) -> list[JsonDict] | None:
        """The answer as the thread keeps it; None when there is nothing to keep."""

    # -- streams -------------------------------------------------------------------------

    @abstractmethod
    def accumulator(self) -> Any:
        """A fresh accumulator of this API's stream (proxy/sse.py)."""

    @abstractmethod
    def feed(self, accumulator: Any, event: SSEEvent, payload: JsonDict | None) -> None:
        """One event into the accumulator, its data parsed once by the caller
        (`event_payload`); BadAnswer when the event is not what this API streams."""

    @abstractmethod
    def final_answer(self, accumulator: Any, event: SSEEvent) -> JsonDict | None:
        """The whole answer when `event` (already fed) is the one that ends it."""

    @abstractmethod
    def usage_holder(self, accumulator: Any) -> JsonDict:
        """What `usage_input_tokens` reads from a stream's accumulator."""

    @abstractmethod
    def rewritten_payload(self, payload: JsonDict, rewrite: Rewrite) -> JsonDict | None:
        """A stream event carrying a response object, with `rewrite` applied; None when
        the event carries none."""

    @abstractmethod
    def error_event(self, message: str, code: str) -> bytes:
        """The error event that ends a stream, in the shape this API's clients parse."""

    def stream_finished(self, body: bytes) -> bool:
        """Whether a whole SSE body (as a client received it) is a finished answer."""
        return stream_finished(self.name, body)


def chat_message(answer: JsonDict) -> JsonDict:
    """Choice 0's message of a chat.completion (the choice the ledger guards)."""
    choices = answer.get("choices") or [{}]
    message = choices[0].get("message")
    return message if isinstance(message, dict) else {}


def reply_message(message: JsonDict, fields: Sequence[str] = REPLY_FIELDS) -> JsonDict:
    """The assistant reply as history: request fields only, nulls dropped."""
    kept = {k: message[k] for k in fields if message.get(k) is not None}
    kept.setdefault("role", "assistant")
    kept.setdefault("content", None)
    return kept


class ChatApi(ApiShape):
    def items(self, history: Any) -> list[Item]:
        return items_from_chat(history)

    def with_items(self, body: JsonDict, items: Sequence[Item]) -> JsonDict:
        body["messages"] = [item.raw for item in items]
        return body

    def item(self, raw: JsonDict) -> Item:
        return chat_item(raw)

    def budget_inputs(self, body: JsonDict) -> BudgetInputs:
        tools = list(body.get("tools") or [])
        # Legacy `functions` count like tools of type function.
        tools += [{"type": "function", "function": f} for f in body.get("functions") or []]
        requested = body.get("max_completion_tokens") or body.get("max_tokens")
        return BudgetInputs(body["model"], tools, requested)

    def call_item(self, tool: str, call_id: str, arguments: str, kind: CallKind) -> Item:
        call = {"id": call_id, "type": kind, kind: {"name": tool, ARGUMENTS_FIELD[kind]: arguments}}
        return chat_item({"role": "assistant", "content": None, "tool_calls": [call]})

    def check_answer(self, answer: Any) -> JsonDict:
        return check_chat_completion(answer)

    def calls(self, answer: JsonDict, rules: Mapping[str, ToolRule]) -> list[ToolCall]:
        return side_effect_calls(chat_message(answer), rules)

    def call_count(self, answer: JsonDict) -> int:
        message = chat_message(answer)
        return len(message.get("tool_calls") or ()) + bool(message.get("function_call"))

    def stripped(self, answer: JsonDict, call_ids: set[str]) -> JsonDict:
        if not call_ids:
            return answer
        choice = dict((answer.get("choices") or [{}])[0])
        message = dict(chat_message(answer))
        calls = [c for c in message.get("tool_calls") or () if c.get("id") not in call_ids]
        if calls:
            message["tool_calls"] = calls
        else:
            message.pop("tool_calls", None)
            if choice.get("finish_reason") == "tool_calls":
                choice["finish_reason"] = "stop"
        choice["message"] = message
        return {**answer, "choices": [choice, *(answer.get("choices") or [])[1:]]}

    def answer_items(self, answer: JsonDict) -> list[JsonDict]:
        return [reply_message(chat_message(answer), CONTINUED_FIELDS)]

    def continued_body(self, sent: JsonDict, added: Sequence[JsonDict]) -> JsonDict:
        body = _unstreamed(sent)
        body["messages"] = [*sent.get("messages", ()), *added]
        return body

    def finished(self, answer: JsonDict) -> bool:
        return True

    def reply(self, answer: JsonDict) -> list[JsonDict] | None:
        choices = answer.get("choices") or []
        if not choices or not isinstance(choices[0].get("message"), dict):
            return None
        return [reply_message(choices[0]["message"])]

    def accumulator(self) -> ChatStreamAccumulator:
        return ChatStreamAccumulator()

    def feed(self, accumulator: Any, event: SSEEvent, payload: JsonDict | None) -> None:
        if payload is not None:
            accumulator.feed(payload)
        elif event.data == DONE:
            accumulator.feed_event(event)

    def final_answer(self, accumulator: Any, event: SSEEvent) -> JsonDict | None:
        if accumulator.finished and event.data == DONE:
            result: JsonDict = accumulator.result()
            return result
        return None

    def usage_holder(self, accumulator: Any) -> JsonDict:
        result: JsonDict = accumulator.result()
        return result

    def rewritten_payload(self, payload: JsonDict, rewrite: Rewrite) -> JsonDict | None:
        return None  # chunks carry no response object

    def error_event(self, message: str, code: str) -> bytes:
        error = error_body(message, "server_error", None, code)["error"]
        return encode_event(json.dumps({"error": error}))


class ResponsesApi(ApiShape):
    def items(self, history: Any) -> list[Item]:
        return list(items_from_responses_input(history).items)

    def with_items(self, body: JsonDict, items: Sequence[Item]) -> JsonDict:
        body["input"] = responses_input_from_items(items)
        return body

    def item(self, raw: JsonDict) -> Item:
        return responses_item(raw)

    def budget_inputs(self, body: JsonDict) -> BudgetInputs:
        # Without `model` (a stored prompt names it): the policy's "*" limits.
        model = body.get("model") or ANY_MODEL
        tools = list(body.get("tools") or [])
        return BudgetInputs(
            model,
            tools,
            body.get("max_output_tokens"),
            body.get("instructions"),
            truncate=body.get("truncation") != "disabled",
        )

    def call_item(self, tool: str, call_id: str, arguments: str, kind: CallKind) -> Item:
        item_type = "custom_tool_call" if kind == "custom" else "function_call"
        raw = {"type": item_type, "call_id": call_id, "name": tool}
        return responses_item({**raw, ARGUMENTS_FIELD[kind]: arguments})

    def check_answer(self, answer: Any) -> JsonDict:
        return check_response(answer)

    def calls(self, answer: JsonDict, rules: Mapping[str, ToolRule]) -> list[ToolCall]:
        return side_effect_calls(list(answer.get("output") or ()), rules)

    def call_count(self, answer: JsonDict) -> int:
        kinds = ("function_call", "custom_tool_call")
        return sum(1 for item in answer.get("output") or () if item.get("type") in kinds)

    def stripped(self, answer: JsonDict, call_ids: set[str]) -> JsonDict:
        if not call_ids:
            return answer
        output = [i for i in answer.get("output") or () if i.get("call_id") not in call_ids]
        return {**answer, "output": output}

    def answer_items(self, answer: JsonDict) -> list[JsonDict]:
        return [dict(item) for item in answer.get("output") or ()]

    def continued_body(self, sent: JsonDict, added: Sequence[JsonDict]) -> JsonDict:
        body = _unstreamed(sent)
        given = sent.get("input")
        if isinstance(given, str):
            given = [{"role": "user", "content": given}]
        body["input"] = [*(given or ()), *added]
        return body

    def finished(self, answer: JsonDict) -> bool:
        return answer.get("status", "completed") == "completed"

    def reply(self, answer: JsonDict) -> list[JsonDict] | None:
        return list(answer.get("output") or ())

    def accumulator(self) -> ResponsesStreamAccumulator:
        return ResponsesStreamAccumulator()

    def feed(self, accumulator: Any, event: SSEEvent, payload: JsonDict | None) -> None:
        if payload is not None:
            accumulator.feed(event.event or str(payload.get("type", "")), payload)

    def final_answer(self, accumulator: Any, event: SSEEvent) -> JsonDict | None:
        if not accumulator.terminal:
            return None
        result: JsonDict | None = accumulator.result()
        return result

    def usage_holder(self, accumulator: Any) -> JsonDict:
        return {"usage": accumulator.usage()}

    def rewritten_payload(self, payload: JsonDict, rewrite: Rewrite) -> JsonDict | None:
        if not isinstance(payload.get("response"), dict):
            return None
        return {**payload, "response": rewrite(payload["response"])}

    def error_event(self, message: str, code: str) -> bytes:
        error = error_body(message, "server_error", None, code)["error"]
        # The spec's flat fields, plus the nested object the SDKs read.
        payload: dict[str, Any] = {
            "type": "error",
            "code": error["code"],
            "message": error["message"],
            "param": error["param"],
            "error": error,
        }
        return encode_event(json.dumps(payload), event="error")


def _unstreamed(sent: JsonDict) -> JsonDict:
    return {k: v for k, v in sent.items() if k not in ("stream", "stream_options")}


CHAT = ChatApi(
    "chat",
    "/chat/completions",
    "messages",
    usage_key="prompt_tokens",
    orphan_text="No tool call found for tool message with tool_call_id {call_id}.",
)
RESPONSES = ResponsesApi(
    "responses",
    "/responses",
    "input",
    usage_key="input_tokens",
    orphan_text="No tool call found for function call output with call_id {call_id}.",
)
# Routes whose answers are a model answer of that API (stored streams must be finished).
BY_ROUTE: Mapping[str, ApiShape] = {CHAT.route: CHAT, RESPONSES.route: RESPONSES}


def for_route(route: str | None) -> ApiShape | None:
    return BY_ROUTE.get(route or "")
