"""Every item type of OpenAI's input item union (issue 24, item 4), through the real socket
with the real `openai` SDK: stored, listed and sent back to the provider unchanged on the
next turn of a conversation and of a `previous_response_id` chain, and counted; MCP
approvals under a small window: a request, its response and its mcp_call never cut
apart, a pending request kept verbatim, and refused (400) rather than dropped when it
alone cannot fit."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from proxy.server.conversations import INCLUDABLE

from .conftest import TENANT_KEY, Proxy


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}
ARGUMENTS = json.dumps({"order": "ORD-5521", "amount": "40 EUR"})

# One of each type, shaped as the spec's schemas (openapi: Item, ItemResource), calls
# followed by their outputs.
SAMPLES: list[dict[str, Any]] = [
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "Check the order first."}],
        "encrypted_content": "gAAAAABencrypted-reasoning-blob",
    },
    {
        "type": "apply_patch_call",
        "id": "apc_1",
        "call_id": "call_patch",
        "status": "completed",
        "operation": {"type": "update_file", "path": "app.py", "diff": "@@ -1 +1 @@\n-a\n+b\n"},
    },
    {
        "type": "apply_patch_call_output",
        "id": "apco_1",
        "call_id": "call_patch",
        "status": "completed",
        "output": "Patched app.py",
    },
    {
        "type": "shell_call",
        "id": "sh_1",
        "call_id": "call_shell",
        "status": "completed",
        "action": {"commands": ["ls -la"], "timeout_ms": 1000, "max_output_length": 4096},
    },
    {
        "type": "shell_call_output",
        "id": "sho_1",
        "call_id": "call_shell",
        "output": [
            {"stdout": "app.py\n", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}
        ],
    },
    {
        "type": "local_shell_call",
        "id": "lsh_1",
        "call_id": "call_local",
        "status": "completed",
        "action": {"type": "exec", "command": ["uname", "-a"], "env": {}},
    },
    # LocalShellToolCallOutput names its call by `id` (the call's call_id).
    {
        "type": "local_shell_call_output",
        "id": "call_local",
        "output": "Linux",
        "status": "completed",
    },
    {
        "type": "computer_call",
        "id": "cu_1",
        "call_id": "call_computer",
        "status": "completed",
        "action": {"type": "click", "button": "left", "x": 12, "y": 40},
        "pending_safety_checks": [],
    },
    {
        "type": "computer_call_output",
        "id": "cuo_1",
        "call_id": "call_computer",
        "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64,iVBORw0K"},
    },
    {"type": "image_generation_call", "id": "ig_1", "status": "completed", "result": "iVBORw0K"},
    {
        "type": "web_search_call",
        "id": "ws_1",
        "status": "completed",
        "action": {"type": "search", "query": "refund policy Lyon"},
    },
    {
        "type": "file_search_call",
        "id": "fs_1",
        "status": "completed",
        "queries": ["refund policy"],
        "results": [{"file_id": "file_1", "filename": "policy.md", "score": 0.9, "text": "30d"}],
    },
    {
        "type": "code_interpreter_call",
        "id": "ci_1",
        "status": "completed",
        "container_id": "cntr_1",
        "code": "print(6 * 7)",
        "outputs": [{"type": "logs", "logs": "42"}],
    },
    {
        "type": "tool_search_call",
        "id": "tsc_1",
        "call_id": "call_search",
        "execution": "client",
        "arguments": {"query": "refund tools"},
        "status": "completed",
    },
    {
        "type": "tool_search_output",
        "id": "tso_1",
        "call_id": "call_search",
        "execution": "client",
        "tools": [],
        "status": "completed",
    },
    {
        "type": "mcp_list_tools",
        "id": "mcpl_1",
        "server_label": "shop",
        "tools": [{"name": "refund", "input_schema": {"type": "object"}}],
    },
    {
        "type": "mcp_approval_request",
        "id": "mcpr_1",
        "server_label": "shop",
        "name": "refund",
        "arguments": ARGUMENTS,
    },
    {
        "type": "mcp_approval_response",
        "id": "mcpa_1",
        "approval_request_id": "mcpr_1",
        "approve": True,
    },
    {
        "type": "mcp_call",
        "id": "mcp_1",
        "server_label": "shop",
        "name": "refund",
        "arguments": ARGUMENTS,
        "output": "Refunded 40 EUR",
        "approval_request_id": "mcpr_1",
        "status": "completed",
    },
]
QUESTION = {"role": "user", "content": "What happened?"}


def sent_input(proxy: Proxy, index: int = -1) -> list[dict[str, Any]]:
    given = proxy.provider.model_requests[index].json["input"]
    assert isinstance(given, list)
    return given


def assert_sent_unchanged(proxy: Proxy, items: list[dict[str, Any]]) -> None:
    """The provider's last request holds each item, every field as the client gave it."""
    sent = sent_input(proxy)
    for item in items:
        assert item in sent, item["type"]
    positions = [sent.index(item) for item in items]
    assert positions == sorted(positions)  # in the log's order


async def listed(proxy: Proxy, path: str) -> list[dict[str, Any]]:
    async with proxy.http() as http:
        # As OpenAI lists them: encrypted reasoning, screenshots, hosted results only when
        # `include` asks for them; all of it here.
        params: dict[str, Any] = {"order": "asc", "limit": 100, "include": list(INCLUDABLE)}
        answer = await http.get(path, params=params, headers=AUTH)
    assert answer.status_code == 200, answer.text
    data = answer.json()["data"]
    assert isinstance(data, list)
    return data


async def test_every_item_type_round_trips_through_a_previous_response_chain(
    proxy: Proxy,
) -> None:
    client = proxy.client()
    first = await client.responses.create(model="gpt-4o", input=[*SAMPLES, QUESTION])  # type: ignore[list-item]
    assert_sent_unchanged(proxy, SAMPLES)
    stored = await listed(proxy, f"/v1/responses/{first.id}/input_items")
    for item in SAMPLES:
        assert item in stored, item["type"]
    second = await client.responses.create(
        model="gpt-4o", previous_response_id=first.id, input="And then?"
    )
    assert second.output_text
    assert_sent_unchanged(proxy, SAMPLES)  # the stored chain sends them back as they came
    third = await client.responses.create(
        model="gpt-4o", previous_response_id=second.id, input="Last one."
    )
    assert third.output_text
    assert_sent_unchanged(proxy, SAMPLES)


async def test_every_item_type_round_trips_through_a_conversation(proxy: Proxy) -> None:
    client = proxy.client()
    conversation = await client.conversations.create(items=SAMPLES[:8])  # type: ignore[arg-type]
    await client.conversations.items.create(conversation.id, items=SAMPLES[8:])  # type: ignore[arg-type]
    items = await listed(proxy, f"/v1/conversations/{conversation.id}/items")
    assert items == SAMPLES  # listed as given, every field
    answer = await client.responses.create(
        model="gpt-4o", conversation=conversation.id, input=[QUESTION]
    )
    assert answer.output_text
    assert_sent_unchanged(proxy, SAMPLES)
    await client.responses.create(model="gpt-4o", conversation=conversation.id, input="More?")
    assert_sent_unchanged(proxy, SAMPLES)
    items = await listed(proxy, f"/v1/conversations/{conversation.id}/items")
    assert items[: len(SAMPLES)] == SAMPLES


async def test_a_compaction_item_round_trips_and_reaches_the_provider_as_its_summary(
    proxy: Proxy,
) -> None:
    """The one type the provider never gets as it is (SPEC 1: expanded to its summary
    text); stored and listed unchanged."""
    client = proxy.client()
    compacted = await client.responses.compact(model="gpt-4o", input=[*SAMPLES, QUESTION])  # type: ignore[arg-type]
    item = compacted.output[-1].model_dump(exclude_unset=True, warnings=False)
    conversation = await client.conversations.create(items=[item])  # type: ignore[list-item]
    assert await listed(proxy, f"/v1/conversations/{conversation.id}/items") == [item]
    await client.responses.create(model="gpt-4o", conversation=conversation.id, input="Go on.")
    sent = json.dumps(sent_input(proxy))
    assert item["encrypted_content"] not in sent and "Refunded 40 EUR" in sent


@pytest.mark.parametrize("item", SAMPLES, ids=[s["type"] for s in SAMPLES])
async def test_every_item_type_is_counted(proxy: Proxy, item: dict[str, Any]) -> None:
    client = proxy.client()
    counted = [
        (await client.responses.input_tokens.count(model="gpt-4o", input=given)).input_tokens  # type: ignore[arg-type]
        for given in ([QUESTION], [item, QUESTION], [item, item | {"id": "x"}, QUESTION])
    ]
    alone, once, twice = counted
    # More than the item overhead: its content is counted, not 0.
    assert once - alone > 3 and twice - once == once - alone


# -- MCP approvals under a small window -------------------------------------------------------


def approval(n: int, words: int = 10) -> dict[str, Any]:
    return {
        "type": "mcp_approval_request",
        "id": f"mcpr_{n}",
        "server_label": "shop",
        "name": "refund",
        "arguments": json.dumps({"order": f"ORD-{n}", "note": "please " * words}),
    }


def answered(n: int) -> list[dict[str, Any]]:
    return [
        {"type": "mcp_approval_response", "approval_request_id": f"mcpr_{n}", "approve": True},
        {
            "type": "mcp_call",
            "id": f"mcp_{n}",
            "server_label": "shop",
            "name": "refund",
            "arguments": "{}",
            "output": f"refunded ORD-{n}",
            "approval_request_id": f"mcpr_{n}",
        },
    ]


def chatter(turn: int) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"question {turn}: " + "tell me more " * 60},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": f"answer {turn} " + "words " * 200}],
        },
    ]


def approval_ids(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [
        (i["type"], i.get("approval_request_id") or i["id"])
        for i in items
        if str(i.get("type", "")).startswith("mcp_")
    ]


async def test_a_pending_approval_survives_every_cut_and_an_answered_one_stays_whole(
    make_proxy: Any,
) -> None:
    proxy = await make_proxy(window=5000)
    client = proxy.client()
    opening: list[Any] = [
        {"role": "user", "content": "Refund both orders."},
        approval(1),
        *answered(1),
    ]
    for turn in range(3):
        opening += chatter(100 + turn)
    opening += [
        {"role": "user", "content": "About ORD-2: refund it too."},
        approval(2),  # a turn in the middle, which later cuts summarize
        {"type": "message", "role": "assistant", "content": "Waiting for your approval."},
    ]
    conversation = await client.conversations.create(items=opening)
    for turn in range(12):
        history = chatter(turn)
        await client.conversations.items.create(conversation.id, items=history[1:])  # type: ignore[arg-type]
        answer = await client.with_raw_response.responses.create(
            model="gpt-4o", conversation=conversation.id, input=[history[0]]
        )  # type: ignore[list-item]
        sent = sent_input(proxy)
        assert approval(2) in sent  # pending: verbatim in every projection
        ids = approval_ids(sent)
        first = [entry for entry in ids if entry[1] == "mcpr_1"]
        assert first in (
            [],
            [
                ("mcp_approval_request", "mcpr_1"),
                ("mcp_approval_response", "mcpr_1"),
                ("mcp_call", "mcpr_1"),
            ],
        )
    assert answer.headers["x-threadkeeper-trimmed"] != "0"
    summaries = [i for i in sent if i.get("role") == "developer"]
    assert summaries and "mcpr_2" not in json.dumps(summaries)  # pending: never summarized

    # Answered now: it becomes an ordinary block the next cuts may take whole.
    await client.responses.create(
        model="gpt-4o",
        conversation=conversation.id,
        input=answered(2)[:1],  # type: ignore[arg-type]
    )
    assert approval(2) in sent_input(proxy)


async def test_a_pending_approval_that_cannot_fit_is_a_400_not_a_silent_drop(
    make_proxy: Any,
) -> None:
    proxy = await make_proxy(window=5000)
    client = proxy.client()
    conversation = await client.conversations.create(
        items=[{"role": "user", "content": "Refund it."}, approval(7, words=6000)]  # type: ignore[list-item]
    )
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="gpt-4o", conversation=conversation.id, input="ok?")
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "context_length_exceeded"
    assert proxy.provider.model_requests == []
    items = await listed(proxy, f"/v1/conversations/{conversation.id}/items")
    assert len(items) == 2  # nothing of the refused turn was kept


async def test_an_approval_answered_after_its_turn_was_cut_is_never_sent_half(
    make_proxy: Any,
) -> None:
    """A pending request carried past a cut, answered later: from then on the request
    is sent with its response and mcp_call, or not at all."""
    proxy = await make_proxy(window=5000)
    client = proxy.client()
    opening: list[Any] = [item for turn in range(3) for item in chatter(200 + turn)]
    opening += [{"role": "user", "content": "Refund ORD-8 when I approve."}, approval(8)]
    opening += [{"type": "message", "role": "assistant", "content": "Waiting."}]
    conversation = await client.conversations.create(items=opening)

    async def turns(count: int, base: int) -> None:
        for turn in range(count):
            history = chatter(base + turn)
            await client.conversations.items.create(conversation.id, items=history[1:])  # type: ignore[arg-type]
            await client.responses.create(
                model="gpt-4o", conversation=conversation.id, input=[history[0]]
            )  # type: ignore[list-item]
            seen.append(approval_ids(sent_input(proxy)))

    seen: list[list[tuple[str, str]]] = []
    await turns(8, 0)
    assert all(("mcp_approval_request", "mcpr_8") in ids for ids in seen)  # pending: kept
    await client.responses.create(
        model="gpt-4o",
        conversation=conversation.id,
        input=answered(8),  # type: ignore[arg-type]
    )
    seen.clear()
    await turns(12, 50)
    whole = [
        ("mcp_approval_request", "mcpr_8"),
        ("mcp_approval_response", "mcpr_8"),
        ("mcp_call", "mcpr_8"),
    ]
    assert all(ids in ([], whole) for ids in seen), seen
    assert seen[-1] == []  # cut away at last, all of it
