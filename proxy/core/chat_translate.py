"""Responses over a provider that only serves Chat Completions (policy `upstream.api`).

The thread keeps Responses items as the client sent them and as the proxy answered; only
the provider's exchange is translated, here, with no I/O:

- `chat_request`: a Responses request (already projected: stateless, its `input` the
  thread's window) becomes a `chat.completions` request. What Chat cannot carry (built-in
  or custom tools, a stored `prompt`, items of hosted tools) is a 400 naming the param,
  raised before anything is forwarded; the proxy's own params are dropped.
- `chat_answer`: a `chat.completion` becomes a Response (the server's
  `reasoning_content` / `reasoning` a reasoning item).
- `ChatStream`: `chat.completion.chunk`s become the Responses event sequence (built by
  proxy/core/events.py), numbered by `sequence_number`; nothing is emitted for a stream
  that never finished, so the relay's cut-off check (proxy/server/relay.py,
  end_of_stream) ends it as it ends a native one.
- `refuses_field`, `cap_ignored`: what a provider's answer says of the output-cap field
  it was sent (proxy/server/chat_upstream.py switches fields on it).

Field names follow /work/shared/openapi (CreateResponse, CreateChatCompletionRequest,
Response, CreateChatCompletionResponse, the Response*Event schemas).

>>> chat_request({"model": "m", "instructions": "Be brief.", "input": "hi"}, ids=str)["messages"]
[{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.core.answers import BadAnswer
from proxy.core.events import (
    CREATED,
    IN_PROGRESS,
    Event,
    Numbering,
    arguments_delta,
    arguments_done,
    call_item,
    content_part,
    error_event,
    item_added,
    item_done,
    message_item,
    part_added,
    part_delta,
    part_done,
    part_text_done,
    reasoning_item,
    snapshot,
    terminal_name,
    text_part,
)
from proxy.core.items import JsonDict
from proxy.core.validate import ApiError, invalid

# A new id for a prefix ("msg", "fc", "call"); the edge gives proxy.ids.new_id.
NewId = Callable[[str], str]

# Responses params that are the proxy's own (served from the store) or mean nothing to a
# stateless Chat call: dropped, never forwarded. `metadata` is refused by Chat without
# `store` at OpenAI and unknown elsewhere.
DROPPED = frozenset(
    {
        "store",
        "include",
        "previous_response_id",
        "conversation",
        "truncation",
        "background",
        "context_management",
        "metadata",
        "stream_options",
        "prompt_cache_retention",
        "max_tool_calls",
    }
)
# Forwarded under the same name (both APIs define them alike).
SAME_NAME = ("model", "temperature", "top_p", "user", "safety_identifier", "service_tier")
# Input items not sent: reasoning (a Chat provider makes none; issue 25), and the items
# the proxy replaces before forwarding (compaction items become summary text, references
# their items: proxy/server/compaction.py, responses.py), seen when a request is checked.
NOT_SENT = frozenset({"reasoning", "compaction", "compaction_trigger", "item_reference"})
PART_TYPES = {"input_text": "text", "output_text": "text", "text": "text"}
# A message's role in Chat (developer text is a system message: every Chat server has it).
SENT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}
# Where a Chat server puts the model's reasoning, in the order they are read.
REASONING_KEYS = ("reasoning_content", "reasoning")


def untranslatable(what: str, param: str) -> ApiError:
    return invalid(
        f"{what} cannot be sent to this upstream: it serves only Chat Completions "
        "(policy upstream.api), which has no equivalent.",
        param=param,
        code="unsupported_parameter",
    )


# -- request -------------------------------------------------------------------------------


def chat_request(
    body: JsonDict, *, ids: NewId, max_tokens_field: str = "max_completion_tokens"
) -> JsonDict:
    """The Chat Completions request for a (projected) Responses request. `ids` makes the
    call id of a function_call that has none; `max_tokens_field` is what the provider
    takes for the output cap (`max_completion_tokens`, the spec's; `max_tokens` where the
    provider refused that: proxy/server/chat_upstream.py)."""
    if body.get("prompt") is not None:
        raise untranslatable("A stored prompt ('prompt')", "prompt")
    sent: JsonDict = {key: body[key] for key in SAME_NAME if body.get(key) is not None}
    sent["messages"] = chat_messages(body.get("input"), body.get("instructions"), ids)
    tools = chat_tools(body.get("tools"))
    if tools:
        sent["tools"] = tools
        if body.get("parallel_tool_calls") is not None:
            sent["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("tool_choice") is not None:
        sent["tool_choice"] = chat_tool_choice(body["tool_choice"])
    sent.update(_text_options(body.get("text")))
    if isinstance(body.get("max_output_tokens"), int):
        sent[max_tokens_field] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        sent["reasoning_effort"] = reasoning["effort"]
    if isinstance(body.get("top_logprobs"), int):
        sent.update(logprobs=True, top_logprobs=body["top_logprobs"])
    if body.get("stream"):
        sent["stream"] = True
        sent["stream_options"] = {"include_usage": True}
    return sent


def chat_messages(value: Any, instructions: Any, ids: NewId) -> list[JsonDict]:
    """The Responses `input` (a string or items) as Chat messages; each run of
    function_call items becomes one assistant message with several `tool_calls`, each
    output a `tool` message with the call's id (the pairs keep their order)."""
    messages: list[JsonDict] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    joins = False  # whether a function_call joins the assistant message before it
    for index, item in enumerate(value or ()):
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, index)
            joins = message["role"] == "assistant"
            messages.append(message)
        elif kind == "function_call":
            call = _tool_call(item, ids)
            if joins:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            joins = True
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _output(output, f"input[{index}]")
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            )
            joins = False
        elif kind not in NOT_SENT:
            raise untranslatable(f"An input item of type '{kind}'", f"input[{index}]")
    return messages


def _tool_call(item: JsonDict, ids: NewId) -> JsonDict:
    return {
        "id": item.get("call_id") or ids("call"),
        "type": "function",
        "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")},
    }


def _message(item: JsonDict, index: int) -> JsonDict:
    """A message item as Chat's: system and developer text as one `system` string, the
    assistant's as one string, the user's as a string or Chat's content parts (the
    form every Chat server takes)."""
    role = item.get("role")
    content = item.get("content")
    sent_role = SENT_ROLES.get(role) if isinstance(role, str) else None
    if sent_role is None:
        raise untranslatable(f"A message of role '{role}'", f"input[{index}].role")
    if isinstance(content, str):
        return {"role": sent_role, "content": content}
    where = f"input[{index}]"
    if sent_role != "user":
        return {"role": sent_role, "content": _plain_text(content, where)}
    parts = [_part(part, f"{where}.content[{i}]") for i, part in enumerate(content or ())]
    if all(part["type"] == "text" for part in parts):
        return {"role": "user", "content": "".join(part["text"] for part in parts)}
    return {"role": "user", "content": parts}


def _plain_text(content: Any, where: str) -> str:
    texts: list[str] = []
    for index, part in enumerate(content or ()):
        kind = part.get("type")
        if kind in PART_TYPES:
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise untranslatable(f"A content part of type '{kind}'", f"{where}.content[{index}]")
    return "".join(texts)


def _part(part: JsonDict, where: str) -> JsonDict:
    kind = part.get("type")
    if kind in PART_TYPES:
        return {"type": "text", "text": str(part.get("text", ""))}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise untranslatable("An input_image given by file_id", f"{where}.file_id")
        image: JsonDict = {"url": url}
        if part.get("detail") is not None:
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        if part.get("file_url") is not None:
            raise untranslatable("An input_file given by file_url", f"{where}.file_url")
        file = {k: part[k] for k in ("file_data", "file_id", "filename") if part.get(k) is not None}
        return {"type": "file", "file": file}
    raise untranslatable(f"A content part of type '{kind}'", where)


def _output(output: Any, where: str) -> str | list[JsonDict]:
    parts = [_part(part, f"{where}.output[{i}]") for i, part in enumerate(output or ())]
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def chat_tools(tools: Any) -> list[JsonDict]:
    """Function tools in Chat's shape; any other tool type is a 400 naming it (a hosted
    tool the provider cannot run is never dropped silently)."""
    out: list[JsonDict] = []
    for index, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            raise untranslatable(f"The tool type '{kind}'", f"tools[{index}]")
        function = {"name": tool.get("name")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice  # none | auto | required, the same in both APIs
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind == "allowed_tools":
        tools = []
        for index, tool in enumerate(choice.get("tools") or ()):
            if tool.get("type") != "function":
                raise untranslatable(
                    f"An allowed tool of type '{tool.get('type')}'", f"tool_choice.tools[{index}]"
                )
            tools.append({"type": "function", "function": {"name": tool.get("name")}})
        mode = choice.get("mode", "auto")
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}
    raise untranslatable(f"A tool_choice of type '{kind}'", "tool_choice")


def _text_options(text: Any) -> JsonDict:
    if not isinstance(text, dict):
        return {}
    options: JsonDict = {}
    if text.get("verbosity") is not None:
        options["verbosity"] = text["verbosity"]
    form = text.get("format")
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "json_object":
        options["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        assert isinstance(form, dict)
        schema = {k: form[k] for k in ("name", "description", "schema", "strict") if k in form}
        options["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif kind not in (None, "text"):
        raise untranslatable(f"A text.format of type '{kind}'", "text.format")
    return options


# -- the output cap ---------------------------------------------------------------------------

# The Chat fields for the output cap: the spec's (`max_tokens` is deprecated there), and
# the one older servers take; each is the other's fallback.
CAP_FIELDS = ("max_completion_tokens", "max_tokens")
OTHER_CAP = {"max_completion_tokens": "max_tokens", "max_tokens": "max_completion_tokens"}
# What a provider's 400 says of a request field it does not take: OpenAI's "Unsupported
# parameter: 'max_tokens' is not supported with this model", vLLM's (pydantic's)
# "extra_forbidden ... Extra inputs are not permitted", "unrecognized" / "unknown" fields.
REFUSALS = (
    "unsupported",
    "not supported",
    "unrecognized",
    "unknown",
    "extra_forbidden",
    "extra inputs",
    "not permitted",
    "not allowed",
)
REFUSAL_BYTES = 4096  # of an error body read for the words above


def cap_field(chat: JsonDict) -> str | None:
    """The output-cap field a Chat request carries, if any."""
    return next((key for key in CAP_FIELDS if key in chat), None)


def with_cap_field(chat: JsonDict, field_name: str) -> JsonDict:
    """The same request with its output cap under `field_name`."""
    old = cap_field(chat)
    if old is None or old == field_name:
        return chat
    swapped = {key: value for key, value in chat.items() if key != old}
    swapped[field_name] = chat[old]
    return swapped


def refuses_field(status: int, body: bytes, field_name: str) -> bool:
    """Whether a provider's error answer says it does not take the request field
    `field_name` (not that its value is wrong): the error's `param` is that field, or its
    text quotes the field and says it is unsupported, unknown or not permitted."""
    if status not in (400, 422):
        return False
    text = body[:REFUSAL_BYTES].decode("utf-8", "replace")
    try:
        parsed = json.loads(text) if len(body) <= REFUSAL_BYTES else None
    except ValueError:
        parsed = None
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    if isinstance(param, str) and param and param != field_name:
        return False
    lower = text.lower()
    named = param == field_name or any(
        f"{quote}{field_name}{quote}" in text for quote in ("'", '"', "`")
    )
    return named and any(word in lower for word in REFUSALS)


def cap_ignored(chat: JsonDict, usage: JsonDict | None) -> bool:
    """Whether the provider answered past the spec's cap field: it ignored
    `max_completion_tokens` (Ollama and older llama.cpp servers take only `max_tokens`
    and drop the other without an error)."""
    cap = chat.get("max_completion_tokens")
    output = usage.get("output_tokens") if isinstance(usage, dict) else None
    return isinstance(cap, int) and isinstance(output, int) and output > cap


# -- answer --------------------------------------------------------------------------------


def response_shell(sent: JsonDict, model: Any, created: Any, response_id: str) -> JsonDict:
    """The Response fields that echo the request (the Response schema's required ones)."""
    given = sent.get("reasoning")
    reasoning: JsonDict = given if isinstance(given, dict) else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created if isinstance(created, int) else 0,
        "status": "in_progress",
        "completed_at": None,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": sent.get("instructions"),
        "max_output_tokens": sent.get("max_output_tokens"),
        "metadata": sent.get("metadata") or {},
        "model": model if isinstance(model, str) else sent.get("model"),
        "output": [],
        "parallel_tool_calls": sent.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": reasoning.get("effort"), "summary": None},
        "store": False,
        "temperature": sent.get("temperature"),
        "text": sent.get("text") or {"format": {"type": "text"}},
        "tool_choice": sent.get("tool_choice", "auto"),
        "tools": sent.get("tools") or [],
        "top_p": sent.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": sent.get("user"),
    }


def response_usage(usage: Any) -> JsonDict | None:
    """Chat's CompletionUsage as ResponseUsage."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": prompt_details.get("cached_tokens") or 0,
            "cache_write_tokens": prompt_details.get("cache_write_tokens") or 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": completion_details.get("reasoning_tokens") or 0
        },
        "total_tokens": usage.get("total_tokens") or prompt + completion,
    }


def finished(response: JsonDict, finish_reason: Any) -> JsonDict:
    """`status` and `incomplete_details` from Chat's finish_reason."""
    reason = INCOMPLETE_REASONS.get(finish_reason) if isinstance(finish_reason, str) else None
    if reason is None:
        return {**response, "status": "completed", "completed_at": response["created_at"]}
    return {**response, "status": "incomplete", "incomplete_details": {"reason": reason}}


def reasoning_text(message: JsonDict) -> str | None:
    """The model's reasoning in a Chat message or delta: `reasoning_content` (vLLM,
    DeepSeek, llama.cpp), or `reasoning` (Ollama, newer vLLM); no Chat schema has either."""
    for key in REASONING_KEYS:
        text = message.get(key)
        if isinstance(text, str) and text:
            return text
    return None


def chat_answer(sent: JsonDict, completion: JsonDict, *, response_id: str, ids: NewId) -> JsonDict:
    """A checked `chat.completion` (proxy/core/answers.py) as the Response OpenAI would
    have returned for `sent`: the first choice's reasoning as a reasoning item, its text
    and refusal in one message item, its tool calls as function_call items with the
    provider's call ids."""
    shell = response_shell(sent, completion.get("model"), completion.get("created"), response_id)
    choices = completion.get("choices") or ()
    if not choices:
        raise BadAnswer("'choices' is empty")
    choice = choices[0]
    message = choice.get("message") or {}
    output: list[JsonDict] = []
    if (thought := reasoning_text(message)) is not None:
        output.append(reasoning_item(ids("rs"), [content_part("reasoning_text", thought)]))
    parts: list[JsonDict] = []
    if isinstance(message.get("content"), str) and message["content"]:
        parts.append(text_part(message["content"]))
    if isinstance(message.get("refusal"), str) and message["refusal"]:
        parts.append(content_part("refusal", message["refusal"]))
    if parts:
        output.append(message_item(ids("msg"), parts))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments")
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
        item = call_item(ids("fc"), call["id"], function.get("name", ""), arguments, "completed")
        output.append(item)
    response = {**shell, "output": output, "usage": response_usage(completion.get("usage"))}
    return finished(response, choice.get("finish_reason"))


# -- stream --------------------------------------------------------------------------------


@dataclass
class _Call:
    output_index: int
    item_id: str
    call_id: str
    name: str
    arguments: str = ""


@dataclass
class _Open:
    """The message or reasoning item being streamed, and its parts so far."""

    kind: str  # message | reasoning
    output_index: int
    item_id: str
    parts: dict[str, tuple[int, str]] = field(default_factory=dict)  # type -> (index, text)


# A Chat delta's text fields: the Responses part each streams into, and that part's item.
DELTA_PARTS = (
    ("content", "output_text", "message"),
    ("refusal", "refusal", "message"),
)
ITEM_IDS = {"message": "msg", "reasoning": "rs"}


class ChatStream:
    """Chat chunks in, Responses events out (each with its `sequence_number`).

    Items get output indexes in the order they first appear; each tool call index of the
    provider is its own function_call item, so interleaved deltas of parallel calls land
    on the right item. Reasoning deltas stream into a reasoning item, text and refusal
    into a message; the open one is closed when the other kind or the first tool call
    starts (a later delta opens another); calls are closed when the answer finishes.
    The terminal event waits for `[DONE]` (or the provider's EOF after a finish_reason)
    because the usage chunk comes after the finish_reason (`stream_options.include_usage`)."""

    def __init__(self, sent: JsonDict, *, response_id: str, ids: NewId) -> None:
        self.sent = sent
        self.response_id = response_id
        self.ids = ids
        self.numbering = Numbering()
        self.shell: JsonDict | None = None
        self.output: dict[int, JsonDict] = {}  # closed items by output index
        self.open: _Open | None = None
        self.calls: dict[int, _Call] = {}  # by the provider's tool call index
        self.finish_reason: str | None = None
        self.usage: JsonDict | None = None
        self.ended = False

    @property
    def next_index(self) -> int:
        return len(self.output) + (self.open is not None) + len(self.calls)

    def chunk(self, chunk: JsonDict) -> list[JsonDict]:
        """One checked chunk (proxy/core/answers.py, check_chat_chunk)."""
        if self.ended:
            return []
        if isinstance(chunk.get("error"), dict):
            self.ended = True
            return self.numbering.events([error_event(chunk["error"])])
        events: list[Event] = []
        if self.shell is None:
            self.shell = response_shell(
                self.sent, chunk.get("model"), chunk.get("created"), self.response_id
            )
            events += [snapshot(CREATED, self.shell), snapshot(IN_PROGRESS, self.shell)]
        if isinstance(chunk.get("usage"), dict):
            self.usage = response_usage(chunk["usage"])
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            events += self._delta(choice.get("delta") or {})
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return self.numbering.events(events)

    def done(self) -> list[JsonDict]:
        """At `[DONE]` or the provider's EOF: the closing events and the terminal one when
        the answer finished; nothing when it was cut off (the relay reports that)."""
        if self.ended or self.finish_reason is None or self.shell is None:
            return []
        self.ended = True
        events = self._close_open()
        for call in sorted(self.calls.values(), key=lambda c: c.output_index):
            events += self._close_call(call)
        self.calls.clear()
        output = [self.output[i] for i in sorted(self.output)]
        final = finished({**self.shell, "output": output, "usage": self.usage}, self.finish_reason)
        return self.numbering.events([*events, snapshot(terminal_name(final), final)])

    def _delta(self, delta: JsonDict) -> list[Event]:
        events: list[Event] = []
        if (thought := reasoning_text(delta)) is not None:
            events += self._part_delta("reasoning", "reasoning_text", thought)
        for key, part, item in DELTA_PARTS:
            if isinstance(delta.get(key), str) and delta[key]:
                events += self._part_delta(item, part, delta[key])
        for call_delta in delta.get("tool_calls") or ():
            events += self._call_delta(call_delta)
        return events

    def _part_delta(self, item_kind: str, kind: str, piece: str) -> list[Event]:
        events: list[Event] = []
        if self.open is not None and self.open.kind != item_kind:
            events += self._close_open()
        if self.open is None:
            self.open = _Open(item_kind, self.next_index, self.ids(ITEM_IDS[item_kind]))
            events.append(
                item_added(self.open.output_index, self._item(self.open, [], "in_progress"))
            )
        current = self.open
        if kind not in current.parts:
            current.parts[kind] = (len(current.parts), "")
            empty = content_part(kind, "")
            index = current.parts[kind][0]
            events.append(part_added(current.item_id, current.output_index, index, empty))
        index, so_far = current.parts[kind]
        current.parts[kind] = (index, so_far + piece)
        events.append(part_delta(kind, current.item_id, current.output_index, index, piece))
        return events

    def _call_delta(self, delta: JsonDict) -> list[Event]:
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        call = self.calls.get(index)
        events: list[Event] = []
        if call is None:
            events += self._close_open()
            call_id = delta.get("id") or self.ids("call")
            call = _Call(self.next_index, self.ids("fc"), call_id, function.get("name") or "")
            self.calls[index] = call
            item = call_item(call.item_id, call.call_id, call.name, "", "in_progress")
            events.append(item_added(call.output_index, item))
        elif function.get("name") and not call.name:
            call.name = function["name"]
        piece = function.get("arguments")
        if isinstance(piece, str) and piece:
            call.arguments += piece
            events.append(arguments_delta(call.item_id, call.output_index, piece))
        return events

    @staticmethod
    def _item(current: _Open, parts: list[JsonDict], status: str) -> JsonDict:
        if current.kind == "reasoning":
            return reasoning_item(current.item_id, parts, status)
        return message_item(current.item_id, parts, status)

    def _close_open(self) -> list[Event]:
        current, self.open = self.open, None
        if current is None:
            return []
        events: list[Event] = []
        parts: list[JsonDict] = []
        for kind, (index, value) in sorted(current.parts.items(), key=lambda p: p[1][0]):
            part = content_part(kind, value)
            events += [
                part_text_done(kind, current.item_id, current.output_index, index, value),
                part_done(current.item_id, current.output_index, index, part),
            ]
            parts.append(part)
        item = self._item(current, parts, "completed")
        self.output[current.output_index] = item
        events.append(item_done(current.output_index, item))
        return events

    def _close_call(self, call: _Call) -> list[Event]:
        item = call_item(call.item_id, call.call_id, call.name, call.arguments, "completed")
        self.output[call.output_index] = item
        return [
            arguments_done(call.item_id, call.output_index, call.name, call.arguments),
            item_done(call.output_index, item),
        ]
