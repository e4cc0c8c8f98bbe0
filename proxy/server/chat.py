"""POST /v1/chat/completions: validate, pick the mode, run the turn (proxy/server/turn.py).

Stateless as at OpenAI, unless the request carries `X-Thread-Id`: then the thread (kind
"chat", created on first use, tenant-scoped) keeps the history (proxy/server/modes.py,
ChatThread): the request's messages are reconciled with it, the context is rebuilt from
the thread under the budget, and the new messages commit with the assistant's reply in
one turn once the reply is complete.
"""

from __future__ import annotations

from aiohttp import web

from proxy.core.validate import validate_chat_message
from proxy.policy import Policy
from proxy.server.api import CHAT
from proxy.server.errors import invalid
from proxy.server.modes import THREAD_HEADER, ChatThread, Stateless
from proxy.server.observe import SummariesAhead, Usage
from proxy.server.state import LOG_FIELDS, TENANT_POLICY
from proxy.server.turn import REWRITERS, Mode, Plan, run_turn
from proxy.server.validate import (
    JsonDict,
    list_of_objects,
    missing,
    optional,
    optional_positive_int,
    read_json_object,
    required_string,
    store_key,
)

MAX_THREAD_ID = 256


def validate_chat(body: JsonDict) -> None:
    """What the provider would reject anyway, and what the projection must read."""
    required_string(body, "model")
    if "messages" not in body:
        raise missing("messages")
    messages = list_of_objects(body["messages"], "messages")
    if not messages:
        raise invalid(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, "
            "but got an empty array instead.",
            param="messages",
            code="empty_array",
        )
    for index, message in enumerate(messages):
        validate_chat_message(message, f"messages[{index}]")
    optional_positive_int(body, "max_tokens")
    optional_positive_int(body, "max_completion_tokens")
    optional(body, "stream", bool)
    tools = optional(body, "tools", list)
    if tools is not None:
        list_of_objects(tools, "tools")
    functions = optional(body, "functions", list)
    if functions is not None:
        list_of_objects(functions, "functions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, raw = await read_json_object(request)
    validate_chat(body)
    refuse_unguarded_choices(body, request[TENANT_POLICY])
    request[LOG_FIELDS].update(model=body["model"])
    thread_id = request.headers.get(THREAD_HEADER)
    mode: Mode = Stateless()
    if thread_id is not None:
        mode = ChatThread(request, thread_id_param(thread_id))
    plan = Plan(mode, REWRITERS, [SummariesAhead(request), Usage()])
    return await run_turn(request, CHAT, body, raw, plan)


def refuse_unguarded_choices(body: JsonDict, policy: Policy) -> None:
    """The side-effect ledger guards the first choice (SPEC 6). With side-effecting tools
    in the policy, `n` > 1 would hand out calls no ledger saw, so it is refused."""
    n = body.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 1:
        return
    if policy.side_effect_tools:
        raise invalid(
            "'n' greater than 1 is not supported for this tenant: its policy has "
            "side-effecting tools, and only one choice can pass the side-effect ledger.",
            param="n",
            code="unsupported_value",
        )


def thread_id_param(value: str) -> str:
    value = store_key(value, THREAD_HEADER).strip()
    if not value or len(value) > MAX_THREAD_ID:
        raise invalid(
            f"Invalid '{THREAD_HEADER}' header: expected 1 to {MAX_THREAD_ID} characters.",
            param=THREAD_HEADER,
            code="invalid_value",
        )
    return value
