"""POST /v1/chat/completions: validate, rebuild under budget, forward, relay.

Stateless as at OpenAI, unless the request carries `X-Thread-Id`: then the thread (kind
"chat", created on first use, tenant-scoped) keeps the history. The request's messages
are reconciled with it (proxy/threads.py, new_chat_messages), the context is rebuilt
from the thread under the budget, and the new messages commit with the assistant's
reply in one turn once the reply is complete.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from proxy.clock import utc_now
from proxy.core.items import Item, chat_from_items, chat_item, items_from_chat
from proxy.core.projection import Projection
from proxy.core.tokens import TokenCounter
from proxy.policy import Policy
from proxy.server.errors import ApiError, invalid
from proxy.server.holdback import Guarded, relay_guarded
from proxy.server.ledger import LedgerGuard, custom_tool_names
from proxy.server.rebuild import context_headers, off_the_loop, rebuild_turn
from proxy.server.relay import relay_kept, relay_response, send_upstream
from proxy.server.state import LOG_FIELDS, NAMESPACE, STORE, TENANT_POLICY, WINDOWS
from proxy.server.validate import (
    JsonDict,
    duplicate_item,
    list_of_objects,
    optional,
    optional_positive_int,
    read_json_object,
    required_string,
    store_key,
    wrong_type,
)
from proxy.threads import Loaded, ThreadService, first_orphan, new_chat_messages, new_items

THREAD_HEADER = "X-Thread-Id"
MAX_THREAD_ID = 256
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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, raw = await read_json_object(request)
    validate_chat(body)
    refuse_unguarded_choices(body, request[TENANT_POLICY])
    request[LOG_FIELDS].update(model=body["model"])
    thread_id = request.headers.get(THREAD_HEADER)
    if thread_id is not None:
        return await _threaded(request, body, thread_id_param(thread_id))
    given = body["messages"]
    guard = LedgerGuard(request, api="chat", thread_id=None, now=utc_now)
    items = await off_the_loop(lambda: items_from_chat(given), given)
    if guard.active:  # a side-effecting call the client never answered (SPEC 6)
        items = await guard.answer_dangling((), items, unguarded_too=False)
    projection, _ = await _rebuild(request, body, items)
    if projection.changed or len(items) != len(given):
        body["messages"] = chat_from_items(projection.items)
        raw = json.dumps(body, ensure_ascii=False).encode()
    await guard.record_outputs(given)
    return await _forward(request, body, raw, projection, keeper=None, guard=guard)


def refuse_unguarded_choices(body: JsonDict, policy: Policy) -> None:
    """The side-effect ledger guards the first choice (SPEC 6). With side-effecting tools
    in the policy, `n` > 1 would hand out calls no ledger saw, so it is refused."""
    n = body.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 1:
        return
    if any(tool.side_effect for tool in policy.tools.values()):
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


async def _rebuild(
    request: web.Request,
    body: JsonDict,
    items: Sequence[Item],
    loaded: Loaded | None = None,
    *,
    observe: bool = True,
) -> tuple[Projection, TokenCounter]:
    return await rebuild_turn(
        request,
        body["model"],
        items,
        loaded,
        tools=_tools(body),
        requested_output=body.get("max_completion_tokens") or body.get("max_tokens"),
        param="messages",
        route="chat.completions",
        observe=observe,
    )


async def _forward(
    request: web.Request,
    body: JsonDict,
    raw: bytes,
    projection: Projection,
    keeper: ChatTurn | None,
    guard: LedgerGuard,
) -> web.StreamResponse:
    upstream = await send_upstream(
        request,
        request[TENANT_POLICY],
        path="/chat/completions",
        body=raw,
        stream=bool(body.get("stream")),
        route="chat.completions",
    )
    extra = context_headers(projection)
    if guard.active:  # SPEC 6: side-effecting calls pass the ledger first
        guarded = Guarded(request, "chat", guard, body, keeper)
        return await relay_guarded(upstream, guarded, extra_headers=extra)
    if keeper is None:
        return await relay_response(request, upstream, family="chat", extra_headers=extra)
    return await relay_kept(request, upstream, family="chat", extra_headers=extra, keeper=keeper)


async def _threaded(request: web.Request, body: JsonDict, thread_id: str) -> web.StreamResponse:
    tenant = request[NAMESPACE]
    request[LOG_FIELDS]["thread_id"] = thread_id
    threads = ThreadService(request.app[STORE], utc_now, cache=request.app[WINDOWS])
    loaded = await threads.load_or_new(tenant, thread_id, "chat")
    if loaded.kind != "chat":
        raise invalid(
            f"Thread '{thread_id}' holds Responses items and cannot be continued with "
            "Chat Completions.",
            param=THREAD_HEADER,
            code="invalid_value",
        )
    messages = body["messages"]
    new = await off_the_loop(lambda: items_from_chat(new_chat_messages(loaded, messages)), messages)
    taken = await threads.first_taken_id(loaded, [item.raw for item in new])
    if taken is not None:  # `new` is a suffix of the request's messages
        index = len(messages) - len(new) + taken
        raise duplicate_item(f"messages[{index}].id", new[taken].raw["id"])
    guard = LedgerGuard(request, api="chat", thread_id=thread_id, now=utc_now)
    if guard.active:
        new = await guard.restore_calls(loaded.items, new, custom_tool_names(_tools(body)))
    orphan = first_orphan(loaded.items, new)
    if orphan is not None:
        raise invalid(
            f"No tool call found for tool message with tool_call_id {orphan}.", param="messages"
        )
    turn_items = await guard.answer_dangling(loaded.items, new, unguarded_too=True)
    projection, counter = await _rebuild(request, body, turn_items, loaded)
    body["messages"] = chat_from_items(projection.items)
    raw = json.dumps(body, ensure_ascii=False).encode()
    await guard.record_outputs([item.raw for item in new])
    turn = ChatTurn(request, body, threads, loaded, turn_items, counter, projection)
    return await _forward(request, body, raw, projection, turn, guard)


# Fields of an assistant reply that a later request may carry (the rest is response-only).
REPLY_FIELDS = ("role", "content", "refusal", "name", "tool_calls", "function_call")


def reply_message(message: JsonDict) -> JsonDict:
    """The assistant reply as history: request fields only, nulls dropped."""
    kept = {k: message[k] for k in REPLY_FIELDS if message.get(k) is not None}
    kept.setdefault("role", "assistant")
    kept.setdefault("content", None)
    return kept


class ChatTurn:
    """A threaded chat turn (relay.Keeper): the new messages and the reply commit
    together once the reply is complete; a cut-off reply adds nothing."""

    def __init__(
        self,
        request: web.Request,
        body: JsonDict,
        threads: ThreadService,
        loaded: Loaded,
        new: Sequence[Item],
        counter: TokenCounter,
        projection: Projection,
    ) -> None:
        self.request = request
        self.body = body
        self.threads = threads
        self.loaded = loaded
        self.new = tuple(new)
        self.counter = counter
        self.projection = projection

    def rewrite(self, response: JsonDict) -> JsonDict:
        return response

    async def keep(self, result: JsonDict, log: Sequence[JsonDict] | None = None) -> None:
        """Commits what the client saw; `log` (a ledger-continued turn's trajectory) is
        not kept on Chat threads (see proxy/server/ledger.py)."""
        choices = result.get("choices") or []
        if not choices or not isinstance(choices[0].get("message"), dict):
            return
        reply = chat_item(reply_message(choices[0]["message"]))
        items = await off_the_loop(
            lambda: [
                *new_items(self.new, self.counter, role="input"),
                *new_items([reply], self.counter, role="output"),
            ],
            reply.raw,
        )
        await self.threads.commit(
            self.loaded,
            items,
            state=self.loaded.state_after(self.projection.cut),
            restate=self._restate,
        )

    async def _restate(self, fresh: Loaded) -> JsonDict:
        try:
            projection, _ = await _rebuild(self.request, self.body, self.new, fresh, observe=False)
        except ApiError:
            return fresh.state
        return fresh.state_after(projection.cut)
