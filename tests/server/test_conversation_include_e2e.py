"""`include` on conversation item reads (issue 8 item 22c): the OpenAI specification's
IncludeEnum lists item data returned only when asked for (encrypted reasoning, output
logprobs, input image URLs...); unknown values are a 400."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from .conftest import TENANT_KEY, Proxy

IMAGE = "https://example.com/receipt.png"
LOGPROBS = [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}]
ITEMS: list[Any] = [
    {
        "type": "message",
        "role": "user",
        "content": [
            {"type": "input_text", "text": "What does it say?"},
            {"type": "input_image", "image_url": IMAGE, "detail": "low"},
        ],
    },
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAB-secret"},
    {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Hi", "annotations": [], "logprobs": LOGPROBS}],
    },
]
ALL = ["reasoning.encrypted_content", "message.output_text.logprobs"]
ALL.append("message.input_image.image_url")


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


async def listed(proxy: Proxy, conversation_id: str, include: list[str] | None) -> list[Any]:
    client = proxy.client()
    page = await client.conversations.items.list(
        conversation_id, order="asc", **({"include": include} if include else {})
    )
    return [item.model_dump() for item in page.data]


async def test_list_returns_included_data_only_when_asked(proxy: Proxy) -> None:
    client = proxy.client()
    conversation = await client.conversations.create(items=ITEMS)

    user, reasoning, answer = await listed(proxy, conversation.id, None)
    assert reasoning.get("encrypted_content") is None
    assert answer["content"][0]["logprobs"] == []
    assert user["content"][1]["image_url"] is None

    user, reasoning, answer = await listed(proxy, conversation.id, ALL)
    assert reasoning["encrypted_content"] == "gAAAAB-secret"
    assert answer["content"][0]["logprobs"] == LOGPROBS
    assert user["content"][1]["image_url"] == IMAGE

    # The stored items are untouched by a read without include.
    retrieved = await client.conversations.items.retrieve(
        "rs_1", conversation_id=conversation.id, include=["reasoning.encrypted_content"]
    )
    assert retrieved.model_dump()["encrypted_content"] == "gAAAAB-secret"
    plain = await client.conversations.items.retrieve("rs_1", conversation_id=conversation.id)
    assert plain.model_dump().get("encrypted_content") is None


@pytest.mark.parametrize("query", ["include=bogus.value", "include[]=reasoning.everything"])
async def test_unknown_include_is_a_400(proxy: Proxy, query: str) -> None:
    client = proxy.client()
    conversation = await client.conversations.create(items=ITEMS)
    async with httpx.AsyncClient(base_url=proxy.base_url) as http:
        headers = {"Authorization": f"Bearer {TENANT_KEY}"}
        listed_ = await http.get(f"/conversations/{conversation.id}/items?{query}", headers=headers)
        one = await http.get(
            f"/conversations/{conversation.id}/items/rs_1?{query}", headers=headers
        )
    for answer in (listed_, one):
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("include", "invalid_value")
        assert query.split("=")[1] in error["message"]


async def test_sdk_include_values_pass(proxy: Proxy) -> None:
    client = proxy.client()
    conversation = await client.conversations.create(items=ITEMS[:1])
    include: Any = ["web_search_call.action.sources", "code_interpreter_call.outputs"]
    page = await client.conversations.items.list(conversation.id, include=include)
    assert len(page.data) == 1
    with pytest.raises(openai.BadRequestError):
        await client.conversations.items.list(conversation.id, include=["nope"])  # type: ignore[list-item]
