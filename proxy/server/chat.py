"""POST /v1/chat/completions: validate, rebuild under budget, forward, relay."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from proxy.core.items import chat_from_items, items_from_chat
from proxy.server.errors import invalid
from proxy.server.rebuild import budget_log_fields, rebuild, trimmed_header
from proxy.server.relay import relay_response, send_upstream
from proxy.server.state import LOG_FIELDS, METRICS, TENANT_POLICY
from proxy.server.validate import (
    JsonDict,
    list_of_objects,
    optional,
    optional_positive_int,
    read_json_object,
    required_string,
    wrong_type,
)

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def validate_chat(body: JsonDict) -> None:
    """What the provider would reject anyway, and what the projection must read."""
    required_string(body, "model")
    if "messages" not in body:
        raise invalid(
            "Missing required parameter: 'messages'.",
            param="messages",
            code="missing_required_parameter",
        )
    messages = list_of_objects(body["messages"], "messages")
    if not messages:
        raise invalid(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, "
            "but got an empty array instead.",
            param="messages",
            code="empty_array",
        )
    for index, message in enumerate(messages):
        validate_message(message, f"messages[{index}]")
    optional_positive_int(body, "max_tokens")
    optional_positive_int(body, "max_completion_tokens")
    optional(body, "stream", bool)
    tools = optional(body, "tools", list)
    if tools is not None:
        list_of_objects(tools, "tools")
    functions = optional(body, "functions", list)
    if functions is not None:
        list_of_objects(functions, "functions")


def validate_message(message: JsonDict, param: str) -> None:
    role = message.get("role")
    if role is None:
        raise invalid(
            f"Missing required parameter: '{param}.role'.",
            param=f"{param}.role",
            code="missing_required_parameter",
        )
    if not isinstance(role, str):
        raise wrong_type(f"{param}.role", "a string", role)
    if role not in CHAT_ROLES:
        raise invalid(
            f"Invalid value: '{role}'. Supported values are: 'system', 'assistant', 'user', "
            "'function', 'tool', and 'developer'.",
            param=f"{param}.role",
            code="invalid_value",
        )
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise wrong_type(f"{param}.content", "a string or an array", content)
    if isinstance(content, list):
        list_of_objects(content, f"{param}.content")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise invalid(
            f"Missing required parameter: '{param}.tool_call_id'.",
            param=f"{param}.tool_call_id",
            code="missing_required_parameter",
        )
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        for index, call in enumerate(list_of_objects(tool_calls, f"{param}.tool_calls")):
            if not isinstance(call.get("id"), str):
                raise invalid(
                    f"Missing required parameter: '{param}.tool_calls[{index}].id'.",
                    param=f"{param}.tool_calls[{index}].id",
                    code="missing_required_parameter",
                )


def _tools(body: JsonDict) -> list[dict[str, Any]]:
    tools = list(body.get("tools") or [])
    # Legacy `functions` count like tools of type function.
    tools += [{"type": "function", "function": f} for f in body.get("functions") or []]
    return tools


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, raw = await read_json_object(request)
    validate_chat(body)
    policy = request[TENANT_POLICY]
    model: str = body["model"]
    request[LOG_FIELDS].update(model=model)
    items = items_from_chat(body["messages"])
    projection, _ = await rebuild(
        policy,
        model,
        items,
        tools=_tools(body),
        requested_output=body.get("max_completion_tokens") or body.get("max_tokens"),
        now=now_iso(),
        param="messages",
        metrics=request.app[METRICS],
        route="chat.completions",
    )
    report = projection.report
    request[LOG_FIELDS].update(budget_log_fields(projection))
    if projection.changed:
        body["messages"] = chat_from_items(projection.items)
        raw = json.dumps(body, ensure_ascii=False).encode()
    stream = bool(body.get("stream"))
    upstream = await send_upstream(
        request, policy, path="/chat/completions", body=raw, stream=stream, route="chat.completions"
    )
    extra = {
        "x-threadkeeper-context-tokens": str(report.prompt_tokens),
        "x-threadkeeper-trimmed": trimmed_header(projection),
    }
    return await relay_response(request, upstream, family="chat", extra_headers=extra)
