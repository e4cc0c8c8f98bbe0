"""The shape a provider's answer must have before the proxy acts on it.

One check per API family and form: a whole Chat completion, one Chat stream chunk, a
whole Response, one Responses stream event. Each checks the fields the proxy reads (the
relay's accumulators, the ledger, the thread commit), not the whole OpenAI schema, and
raises `BadAnswer` naming the first field that is wrong. Every flow (stateless, threaded,
stored, ledger-guarded, streamed or not) runs its answer through these, so a wrong-shaped
answer is one clean error (a 502, or an error event in a stream) and nothing is stored.

>>> check_chat_completion({"choices": "x"})
Traceback (most recent call last):
...
proxy.core.answers.BadAnswer: The provider's answer is malformed: 'choices' is not an array.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.core.events import (
    COMPLETED,
    CONTENT_EVENTS,
    DELTA_TEXT,
    DONE_TEXT,
    ITEM_EVENTS,
    PART_EVENTS,
    SNAPSHOT_EVENTS,
    TERMINAL_EVENTS,
)
from proxy.core.items import Api, JsonDict

CALL_ITEM_TYPES = frozenset({"function_call", "custom_tool_call"})


class BadAnswer(ValueError):
    """The provider's answer does not have the shape its API promises."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"The provider's answer is malformed: {problem}.")
        self.problem = problem


def check_answer(family: Api, answer: Any) -> JsonDict:
    """A whole (non-streamed) answer of either API, checked."""
    if family == "chat":
        return check_chat_completion(answer)
    return check_response(answer)


# -- Chat Completions ---------------------------------------------------------------------------


def check_chat_completion(answer: Any) -> JsonDict:
    answer = _object(answer, "the answer")
    choices = _list(answer, "choices", required=True)
    for index, choice in enumerate(choices):
        where = f"choices[{index}]"
        choice = _object(choice, f"'{where}'")
        _int(choice, "index", where)
        _str(choice, "finish_reason", where)
        message = _object(choice.get("message"), f"'{where}.message'")
        _message(message, f"{where}.message")
    _object_or_none(answer, "usage", "")
    return answer


def _message(message: JsonDict, where: str) -> None:
    _str(message, "role", where)
    _str(message, "refusal", where)
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise BadAnswer(f"'{where}.content' is neither a string nor an array")
    for index, call in enumerate(_list(message, "tool_calls", where) or ()):
        call_where = f"{where}.tool_calls[{index}]"
        call = _object(call, f"'{call_where}'")
        if not isinstance(call.get("id"), str):
            raise BadAnswer(f"'{call_where}.id' is not a string")
        _str(call, "type", call_where)
        for kind in ("function", "custom"):
            if (body := _object_or_none(call, kind, call_where)) is not None:
                _str(body, "name", f"{call_where}.{kind}")
    if (legacy := _object_or_none(message, "function_call", where)) is not None:
        _str(legacy, "name", f"{where}.function_call")


def check_chat_chunk(chunk: Any) -> JsonDict:
    """One `chat.completion.chunk` of a stream."""
    chunk = _object(chunk, "a stream chunk")
    for index, choice in enumerate(_list(chunk, "choices") or ()):
        where = f"choices[{index}]"
        choice = _object(choice, f"'{where}'")
        _int(choice, "index", where)
        _str(choice, "finish_reason", where)
        _object_or_none(choice, "logprobs", where)
        if (delta := _object_or_none(choice, "delta", where)) is not None:
            _delta(delta, f"{where}.delta")
    _object_or_none(chunk, "usage", "")
    return chunk


def _delta(delta: JsonDict, where: str) -> None:
    for key in ("role", "content", "refusal"):
        _str(delta, key, where)
    for index, call in enumerate(_list(delta, "tool_calls", where) or ()):
        call_where = f"{where}.tool_calls[{index}]"
        call = _object(call, f"'{call_where}'")
        _int(call, "index", call_where)
        _str(call, "id", call_where)
        _str(call, "type", call_where)
        if (function := _object_or_none(call, "function", call_where)) is not None:
            _str(function, "name", f"{call_where}.function")
            _str(function, "arguments", f"{call_where}.function")
    if (legacy := _object_or_none(delta, "function_call", where)) is not None:
        _str(legacy, "name", f"{where}.function_call")
        _str(legacy, "arguments", f"{where}.function_call")


# -- Responses ----------------------------------------------------------------------------------


def check_response(answer: Any, where: str = "", *, output_required: bool = True) -> JsonDict:
    """A whole Response object (non-streamed, or carried by a terminal stream event; a
    failed or incomplete one may come without `output`)."""
    answer = _object(answer, f"'{where}'" if where else "the answer")
    output = _list(answer, "output", where, required=output_required)
    for index, item in enumerate(output):
        _output_item(item, _join(where, f"output[{index}]"))
    _str(answer, "status", where)
    _object_or_none(answer, "usage", where)
    _object_or_none(answer, "error", where)
    return answer


def _output_item(item: Any, where: str) -> JsonDict:
    item = _object(item, f"'{where}'")
    if not isinstance(item.get("type"), str):
        raise BadAnswer(f"'{where}.type' is not a string")
    if item["type"] in CALL_ITEM_TYPES:
        for key in ("call_id", "name"):
            if not isinstance(item.get(key), str):
                raise BadAnswer(f"'{where}.{key}' is not a string")
    if item["type"] == "message":
        for index, part in enumerate(_list(item, "content", where) or ()):
            _object(part, f"'{where}.content[{index}]'")
    return item


def check_response_event(kind: str, data: Any) -> JsonDict:
    """One event of a Responses stream (`kind` is its event name or `type`)."""
    data = _object(data, f"the '{kind}' event")
    if kind in TERMINAL_EVENTS:
        required = kind == COMPLETED
        check_response(data.get("response"), "response", output_required=required)
    elif kind in SNAPSHOT_EVENTS:
        snapshot = _object(data.get("response"), "'response'")
        _list(snapshot, "output", "response")
    if "output_index" in data or kind in ITEM_EVENTS:
        _int(data, "output_index", "", required=True)
    _int(data, "content_index", "", required=kind in CONTENT_EVENTS)
    if kind in ITEM_EVENTS:
        _output_item(data.get("item"), "item")
    if kind in PART_EVENTS:
        _object(data.get("part"), "'part'")
    if kind in DELTA_TEXT:
        _str(data, "delta", "")
    if field := DONE_TEXT.get(kind):
        if not isinstance(data.get(field), str):
            raise BadAnswer(f"'{field}' of a '{kind}' event is not a string")
    return data


# -- field checks -------------------------------------------------------------------------------


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _object(value: Any, what: str) -> JsonDict:
    if not isinstance(value, Mapping):
        raise BadAnswer(f"{what} is not a JSON object")
    return dict(value) if not isinstance(value, dict) else value


def _object_or_none(parent: JsonDict, key: str, where: str) -> JsonDict | None:
    value = parent.get(key)
    if value is None:
        return None
    return _object(value, f"'{_join(where, key)}'")


def _list(parent: JsonDict, key: str, where: str = "", *, required: bool = False) -> list[Any]:
    value = parent.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list):
        raise BadAnswer(f"'{_join(where, key)}' is not an array")
    return value


def _str(parent: JsonDict, key: str, where: str) -> None:
    value = parent.get(key)
    if value is not None and not isinstance(value, str):
        raise BadAnswer(f"'{_join(where, key)}' is not a string")


def _int(parent: JsonDict, key: str, where: str, *, required: bool = False) -> None:
    value = parent.get(key)
    if value is None and not required:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadAnswer(f"'{_join(where, key)}' is not a non-negative integer")
