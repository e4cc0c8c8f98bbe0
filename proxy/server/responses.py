"""POST /v1/responses and /v1/responses/input_tokens (stateless mode).

Requests with `conversation` or `previous_response_id` are forwarded unchanged until the
store serves those modes locally.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from proxy.core.items import ResponsesInput, items_from_responses_input, responses_input_from_items
from proxy.core.tokens import TokenCounter
from proxy.server.chat import now_iso
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


def validate_responses(body: JsonDict) -> None:
    required_string(body, "model")
    value = body.get("input")
    if value is not None and not isinstance(value, str):
        for index, item in enumerate(list_of_objects(value, "input")):
            validate_input_item(item, f"input[{index}]")
    optional(body, "instructions", str)
    optional_positive_int(body, "max_output_tokens")
    optional(body, "stream", bool)
    optional(body, "store", bool)
    tools = optional(body, "tools", list)
    if tools is not None:
        list_of_objects(tools, "tools")
    if body.get("conversation") is not None and body.get("previous_response_id") is not None:
        raise invalid(
            "Mutually exclusive parameters: Ensure you are only providing one of: "
            "'previous_response_id' or 'conversation'.",
            code="mutually_exclusive_parameters",
        )
    conversation = body.get("conversation")
    if conversation is not None and not isinstance(conversation, str | dict):
        raise wrong_type("conversation", "a string or an object", conversation)
    optional(body, "previous_response_id", str)


def validate_input_item(item: JsonDict, param: str) -> None:
    item_type = item.get("type")
    if item_type is not None and not isinstance(item_type, str):
        raise wrong_type(f"{param}.type", "a string", item_type)
    role = item.get("role")
    if item_type in (None, "message"):
        if role is None:
            raise invalid(
                f"Missing required parameter: '{param}.role'.",
                param=f"{param}.role",
                code="missing_required_parameter",
            )
        if not isinstance(role, str):
            raise wrong_type(f"{param}.role", "a string", role)
        content = item.get("content")
        if not isinstance(content, str | list):
            raise wrong_type(f"{param}.content", "a string or an array", content)
    if item_type in ("function_call", "function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("call_id"), str):
            raise invalid(
                f"Missing required parameter: '{param}.call_id'.",
                param=f"{param}.call_id",
                code="missing_required_parameter",
            )


def is_stateful(body: JsonDict) -> bool:
    return body.get("conversation") is not None or body.get("previous_response_id") is not None


def _input(body: JsonDict) -> ResponsesInput:
    value = body.get("input")
    return items_from_responses_input(value if value is not None else [])


async def create_response(request: web.Request) -> web.StreamResponse:
    body, raw = await read_json_object(request)
    validate_responses(body)
    policy = request[TENANT_POLICY]
    model: str = body["model"]
    request[LOG_FIELDS].update(model=model)
    stream = bool(body.get("stream"))
    extra: dict[str, str] = {}
    if not is_stateful(body):
        parsed = _input(body)
        projection, _ = await rebuild(
            policy,
            model,
            parsed.items,
            tools=list(body.get("tools") or []),
            requested_output=body.get("max_output_tokens"),
            instructions=body.get("instructions"),
            now=now_iso(),
            param="input",
            metrics=request.app[METRICS],
            route="responses",
        )
        request[LOG_FIELDS].update(budget_log_fields(projection))
        if projection.changed:
            body["input"] = responses_input_from_items(projection.items)
            raw = json.dumps(body, ensure_ascii=False).encode()
        extra = {
            "x-threadkeeper-context-tokens": str(projection.report.prompt_tokens),
            "x-threadkeeper-trimmed": trimmed_header(projection),
        }
    upstream = await send_upstream(
        request, policy, path="/responses", body=raw, stream=stream, route="responses"
    )
    return await relay_response(request, upstream, family="responses", extra_headers=extra)


async def input_tokens(request: web.Request) -> web.StreamResponse:
    body, raw = await read_json_object(request)
    if body.get("model") is not None:
        optional(body, "model", str)
    validate_responses({**body, "model": body.get("model") or "gpt-4o"})
    policy = request[TENANT_POLICY]
    if is_stateful(body):
        upstream = await send_upstream(
            request,
            policy,
            path="/responses/input_tokens",
            body=raw,
            stream=False,
            route="responses.input_tokens",
        )
        return await relay_response(request, upstream, family=None, extra_headers={})
    counter = TokenCounter.for_model(body.get("model") or "gpt-4o")
    tools: list[dict[str, Any]] = list(body.get("tools") or [])
    count = counter.responses_prompt(_input(body).items, body.get("instructions"), tools)
    return web.json_response({"object": "response.input_tokens", "input_tokens": count})
