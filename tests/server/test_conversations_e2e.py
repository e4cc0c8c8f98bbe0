"""Conversations API and forks, served from the local store, through a real socket with
the openai SDK as the client."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import openai
import pytest

from proxy.fake_provider import Reply
from proxy.server.state import STORE
from tests.server.conftest import Proxy

JsonDict = dict[str, Any]


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


def user(text: str) -> JsonDict:
    return {"role": "user", "content": text}


def call(call_id: str) -> JsonDict:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": "get_order",
        "arguments": json.dumps({"order_id": "ORD-1"}),
    }


def output(call_id: str) -> JsonDict:
    return {"type": "function_call_output", "call_id": call_id, "output": '{"status":"shipped"}'}


async def create(proxy: Proxy, items: list[JsonDict], **kwargs: Any) -> str:
    conversation = await proxy.client().conversations.create(items=items, **kwargs)  # type: ignore[arg-type]
    return conversation.id


async def listed(proxy: Proxy, conversation_id: str, **kwargs: Any) -> list[JsonDict]:
    """Every item of the conversation, following the SDK's own pagination."""
    pages = proxy.client().conversations.items.list(conversation_id, **kwargs)
    return [item.model_dump(exclude_unset=True) async for item in pages]


async def thread_total(proxy: Proxy) -> int:
    """Threads in the proxy's store, counted beside the contract (which lists none)."""
    async with proxy.app[STORE].db.read() as conn:  # type: ignore[attr-defined,index]
        return int((await conn.fetchrow("SELECT count(*) FROM threads"))[0])


async def test_create_with_items_and_metadata(proxy: Proxy) -> None:
    client = proxy.client()
    before = int(time.time())
    conversation = await client.conversations.create(
        items=[user("Where is my order?"), call("call_1"), output("call_1")],  # type: ignore[list-item]
        metadata={"topic": "orders", "customer": "c-42"},
    )
    assert conversation.id.startswith("conv_")
    assert conversation.object == "conversation"
    assert conversation.metadata == {"topic": "orders", "customer": "c-42"}
    assert conversation.created_at >= before - 1

    again = await client.conversations.retrieve(conversation.id)
    assert again.model_dump() == conversation.model_dump()

    items = await listed(proxy, conversation.id, order="asc")
    assert [item["type"] for item in items] == ["message", "function_call", "function_call_output"]
    message = items[0]
    assert message["id"].startswith("msg_")
    assert message["status"] == "completed"
    assert message["role"] == "user"
    assert message["content"] == [{"type": "input_text", "text": "Where is my order?"}]
    assert items[1]["call_id"] == items[2]["call_id"] == "call_1"
    assert proxy.provider.requests == []  # served locally, never forwarded


async def test_stored_items_keep_the_raw_json_and_a_token_count(proxy: Proxy) -> None:
    raw = user("Hello there")
    conversation_id = await create(proxy, [raw])
    [item] = await listed(proxy, conversation_id)
    stored = await proxy.app[STORE].get_item("acme", conversation_id, item["id"])  # type: ignore[index]
    assert stored is not None
    assert stored.raw == raw  # no id, type, status or content parts written back
    assert stored.api == "responses"
    assert stored.encoding == "o200k_base"
    assert stored.tokens > 0


async def test_item_ids_sent_by_the_client_are_kept(proxy: Proxy) -> None:
    message = {"type": "message", "id": "msg_client_1", "role": "user", "content": "hi"}
    conversation_id = await create(proxy, [message])
    item = await proxy.client().conversations.items.retrieve(
        "msg_client_1", conversation_id=conversation_id
    )
    assert item.id == "msg_client_1"


async def test_list_pages_in_both_orders(proxy: Proxy) -> None:
    client = proxy.client()
    conversation_id = await create(proxy, [user(f"message {n}") for n in range(5)])
    everything = await listed(proxy, conversation_id, order="asc")
    ids = [item["id"] for item in everything]
    assert [item["content"][0]["text"] for item in everything] == [f"message {n}" for n in range(5)]

    first = await client.conversations.items.list(conversation_id, limit=2, order="asc")
    assert [item.id for item in first.data] == ids[:2]
    assert (first.first_id, first.last_id, first.has_more) == (ids[0], ids[1], True)
    second = await client.conversations.items.list(
        conversation_id, limit=2, order="asc", after=ids[1]
    )
    assert [item.id for item in second.data] == ids[2:4]
    assert second.has_more is True
    last = await client.conversations.items.list(
        conversation_id, limit=2, order="asc", after=ids[3]
    )
    assert [item.id for item in last.data] == ids[4:]
    assert last.has_more is False

    newest = await client.conversations.items.list(conversation_id, limit=3)  # default desc
    assert [item.id for item in newest.data] == ids[::-1][:3]
    assert newest.has_more is True
    assert [item["id"] for item in await listed(proxy, conversation_id, limit=2)] == ids[::-1]
    default_page = await client.conversations.items.list(conversation_id)
    assert len(default_page.data) == 5
    assert default_page.has_more is False


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"order": "up"}, "order"),
    ],
)
async def test_list_rejects_bad_parameters(proxy: Proxy, query: dict[str, str], param: str) -> None:
    conversation_id = await create(proxy, [user("hi")])
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client().conversations.items.list(conversation_id, extra_query=query)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param  # type: ignore[index]


async def test_list_after_an_unknown_item_is_404(proxy: Proxy) -> None:
    conversation_id = await create(proxy, [user("hi")])
    with pytest.raises(openai.NotFoundError, match=r"Item with id 'msg_nope' not found\."):
        await proxy.client().conversations.items.list(conversation_id, after="msg_nope")


async def test_item_retrieve_and_delete(proxy: Proxy) -> None:
    client = proxy.client()
    conversation_id = await create(proxy, [user("keep"), user("drop")])
    keep, drop = [item["id"] for item in await listed(proxy, conversation_id, order="asc")]

    item = await client.conversations.items.retrieve(drop, conversation_id=conversation_id)
    assert item.type == "message"
    assert item.id == drop

    conversation = await client.conversations.items.delete(drop, conversation_id=conversation_id)
    assert conversation.id == conversation_id
    assert conversation.object == "conversation"
    assert [item["id"] for item in await listed(proxy, conversation_id)] == [keep]
    with pytest.raises(openai.NotFoundError, match=re.escape(f"Item with id '{drop}' not found.")):
        await client.conversations.items.retrieve(drop, conversation_id=conversation_id)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.delete(drop, conversation_id=conversation_id)


async def test_update_replaces_metadata(proxy: Proxy) -> None:
    client = proxy.client()
    conversation_id = await create(proxy, [], metadata={"a": "1", "b": "2"})
    updated = await client.conversations.update(conversation_id, metadata={"c": "3"})
    assert updated.metadata == {"c": "3"}
    assert (await client.conversations.retrieve(conversation_id)).metadata == {"c": "3"}


async def test_delete_then_everything_is_404(proxy: Proxy) -> None:
    client = proxy.client()
    conversation_id = await create(proxy, [user("hi")])
    deleted = await client.conversations.delete(conversation_id)
    assert (deleted.id, deleted.object, deleted.deleted) == (
        conversation_id,
        "conversation.deleted",
        True,
    )
    message = f"Conversation with id '{conversation_id}' not found."
    with pytest.raises(openai.NotFoundError, match=re.escape(message)) as caught:
        await client.conversations.retrieve(conversation_id)
    assert caught.value.body == {  # type: ignore[comparison-overlap]
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.list(conversation_id)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.delete(conversation_id)


async def test_too_many_items_is_400_and_stores_nothing(proxy: Proxy) -> None:
    client = proxy.client()
    with pytest.raises(openai.BadRequestError, match="maximum length 20") as caught:
        await client.conversations.create(items=[user(str(n)) for n in range(21)])  # type: ignore[misc]
    assert caught.value.body["param"] == "items"  # type: ignore[index]

    conversation_id = await create(proxy, [user("first")])
    with pytest.raises(openai.BadRequestError, match="maximum length 20"):
        await client.conversations.items.create(
            conversation_id,
            items=[user(str(n)) for n in range(21)],  # type: ignore[misc]
        )
    with pytest.raises(openai.BadRequestError, match="empty array"):
        await client.conversations.items.create(conversation_id, items=[])
    assert len(await listed(proxy, conversation_id)) == 1
    stored = await proxy.app[STORE].get_thread("acme", conversation_id)  # type: ignore[index]
    assert stored is not None and stored.next_seq == 1


async def test_failed_create_leaves_no_conversation_behind(proxy: Proxy) -> None:
    client = proxy.client()
    await create(proxy, [user("a real one")])
    bad_creates = [
        {"items": [user("a"), output("call_missing")]},
        {"items": [user(str(n)) for n in range(21)]},
        {"items": [user("a"), {"role": "robot", "content": "x"}]},
        {"metadata": {"k": 1}},
    ]
    for body in bad_creates:
        with pytest.raises(openai.BadRequestError):
            await client.conversations.create(**body)
    assert await thread_total(proxy) == 1


async def test_orphan_output_is_400_and_stores_nothing(proxy: Proxy) -> None:
    client = proxy.client()
    conversation_id = await create(proxy, [user("refund my order"), call("call_1")])
    with pytest.raises(
        openai.BadRequestError,
        match=r"No tool call found for function call output with call_id call_9\.",
    ):
        await client.conversations.items.create(
            conversation_id,
            items=[user("also this"), output("call_9")],  # type: ignore[list-item]
        )
    assert len(await listed(proxy, conversation_id)) == 2

    # Outputs answering a call already stored, or made earlier in the same request, are fine.
    added = await client.conversations.items.create(
        conversation_id,
        items=[output("call_1"), call("call_2"), output("call_2")],  # type: ignore[list-item]
    )
    assert [item.type for item in added.data] == [
        "function_call_output",
        "function_call",
        "function_call_output",
    ]
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id
    assert [item["id"] for item in await listed(proxy, conversation_id, order="asc")][2:] == [
        item.id for item in added.data
    ]


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{n}": "v" for n in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": 1},
        ["not", "an", "object"],
    ],
)
async def test_bad_metadata_is_400_and_changes_nothing(proxy: Proxy, metadata: Any) -> None:
    client = proxy.client()
    with pytest.raises(openai.BadRequestError):
        await client.conversations.create(metadata=metadata)
    conversation_id = await create(proxy, [], metadata={"kept": "yes"})
    with pytest.raises(openai.BadRequestError):
        await client.conversations.update(conversation_id, metadata=metadata)
    assert (await client.conversations.retrieve(conversation_id)).metadata == {"kept": "yes"}


async def test_metadata_at_the_limits_is_accepted(proxy: Proxy) -> None:
    metadata = {f"{n:02d}" + "k" * 62: "v" * 512 for n in range(16)}
    conversation = await proxy.client().conversations.create(metadata=metadata)
    assert conversation.metadata == metadata


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"content": "no role"}, "items[1].role"),
        ({"role": "robot", "content": "hi"}, "items[1].role"),
        ({"role": "user", "content": 7}, "items[1].content"),
        ({"role": "user", "content": ["bare string part"]}, "items[1].content[0]"),
        ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "items[1].name"),
        ({"type": "function_call_output", "output": "x"}, "items[1].call_id"),
        ({"type": "item_reference", "id": "msg_1"}, "items[1].type"),
        ("not an object", "items[1]"),
    ],
)
async def test_invalid_item_shapes_are_400_naming_the_item(
    proxy: Proxy, item: Any, param: str
) -> None:
    client = proxy.client()
    with pytest.raises(openai.BadRequestError) as caught:
        await client.conversations.create(items=[user("fine"), item])
    assert caught.value.body["param"] == param  # type: ignore[index]
    conversation_id = await create(proxy, [])
    with pytest.raises(openai.BadRequestError):
        await client.conversations.items.create(conversation_id, items=[user("fine"), item])
    assert await listed(proxy, conversation_id) == []


async def test_malformed_bodies_are_400(proxy: Proxy) -> None:
    conversation_id = await create(proxy, [])
    async with proxy.http() as http:
        headers = {"Authorization": "Bearer sk-tk-acme-test-key"}
        for path, body in [
            ("/v1/conversations", b"{not json"),
            ("/v1/conversations", b"[]"),
            (f"/v1/conversations/{conversation_id}", b"{}"),
            (f"/v1/conversations/{conversation_id}/items", b"{}"),
            (f"/v1/conversations/{conversation_id}/items", b'{"items": {"role": "user"}}'),
            (f"/threadkeeper/v1/conversations/{conversation_id}/fork", b'{"item_id": 3}'),
        ]:
            response = await http.post(path, content=body, headers=headers)
            assert response.status_code == 400, (path, body, response.text)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_another_tenant_sees_404(proxy: Proxy) -> None:
    owner = proxy.client()
    conversation_id = await create(proxy, [user("secret")], metadata={"owner": "acme"})
    [item] = await listed(proxy, conversation_id)
    stranger = proxy.client(api_key="sk-some-other-key")
    attempts = [
        stranger.conversations.retrieve(conversation_id),
        stranger.conversations.update(conversation_id, metadata={"owner": "me"}),
        stranger.conversations.items.list(conversation_id),
        stranger.conversations.items.create(conversation_id, items=[user("mine")]),  # type: ignore[list-item]
        stranger.conversations.items.retrieve(item["id"], conversation_id=conversation_id),
        stranger.conversations.items.delete(item["id"], conversation_id=conversation_id),
        stranger.conversations.delete(conversation_id),
    ]
    for attempt in attempts:
        with pytest.raises(openai.NotFoundError):
            await attempt  # type: ignore[misc]
    assert (await owner.conversations.retrieve(conversation_id)).metadata == {"owner": "acme"}
    assert [i["id"] for i in await listed(proxy, conversation_id)] == [item["id"]]
    assert proxy.provider.requests == []


async def fork(proxy: Proxy, conversation_id: str, body: JsonDict | None, key: str | None = None):  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {key or 'sk-tk-acme-test-key'}"}
    async with proxy.http() as http:
        path = f"/threadkeeper/v1/conversations/{conversation_id}/fork"
        if body is None:
            return await http.post(path, headers=headers)
        return await http.post(path, json=body, headers=headers)


async def test_fork_at_an_item_then_both_grow_apart(proxy: Proxy) -> None:
    client = proxy.client()
    source_id = await create(proxy, [user("one"), user("two"), user("three")])
    one, two, _three = [item["id"] for item in await listed(proxy, source_id, order="asc")]

    response = await fork(proxy, source_id, {"item_id": two})
    assert response.status_code == 200, response.text
    forked = response.json()
    assert forked["object"] == "conversation" and forked["id"].startswith("conv_")
    assert forked["id"] != source_id
    fork_id = forked["id"]
    fork_items = await listed(proxy, fork_id, order="asc")
    assert [item["content"][0]["text"] for item in fork_items] == ["one", "two"]

    await client.conversations.items.create(fork_id, items=[user("fork only")])  # type: ignore[list-item]
    await client.conversations.items.create(source_id, items=[user("source only")])  # type: ignore[list-item]
    texts = {
        cid: [item["content"][0]["text"] for item in await listed(proxy, cid, order="asc")]
        for cid in (source_id, fork_id)
    }
    assert texts[source_id] == ["one", "two", "three", "source only"]
    assert texts[fork_id] == ["one", "two", "fork only"]

    # Deleting in the fork leaves the source whole.
    await client.conversations.items.delete(fork_items[0]["id"], conversation_id=fork_id)
    assert (await listed(proxy, source_id, order="asc"))[0]["id"] == one
    await client.conversations.delete(fork_id)
    assert len(await listed(proxy, source_id)) == 4


async def test_fork_without_item_copies_everything(proxy: Proxy) -> None:
    source_id = await create(proxy, [user("a"), call("call_1"), output("call_1")])
    for body in (None, {}):
        response = await fork(proxy, source_id, body)
        assert response.status_code == 200, response.text
        fork_items = await listed(proxy, response.json()["id"], order="asc")
        assert [item["type"] for item in fork_items] == [
            "message",
            "function_call",
            "function_call_output",
        ]


async def test_fork_errors(proxy: Proxy) -> None:
    source_id = await create(proxy, [user("a")])
    unknown_item = await fork(proxy, source_id, {"item_id": "msg_nope"})
    assert unknown_item.status_code == 404
    assert unknown_item.json()["error"]["message"] == "Item with id 'msg_nope' not found."
    unknown_conversation = await fork(proxy, "conv_nope", {})
    assert unknown_conversation.status_code == 404
    other_tenant = await fork(proxy, source_id, {}, key="sk-some-other-key")
    assert other_tenant.status_code == 404


async def test_fork_is_authenticated_like_v1(make_proxy) -> None:  # type: ignore[no-untyped-def]
    proxy = await make_proxy(allow_unknown=False)
    source_id = await create(proxy, [user("a")])
    unknown_key = await fork(proxy, source_id, {}, key="sk-some-other-key")
    assert unknown_key.status_code == 401
    assert unknown_key.json()["error"]["code"] == "invalid_api_key"
    async with proxy.http() as http:
        anonymous = await http.post(f"/threadkeeper/v1/conversations/{source_id}/fork", json={})
    assert anonymous.status_code == 401


async def test_a_deleted_item_leaves_the_summary_that_quoted_it(make_proxy: Any) -> None:
    """A conversation cut with a summary quoting a message: deleting that message drops
    the cut, so the next turn's summary, rebuilt from the log, no longer quotes it."""
    proxy: Proxy = await make_proxy(window=6000)
    client = proxy.client()
    conversation_id = await create(proxy, [])
    secret = "My rule: ship only to PO box 4471, never to my home."
    for number in range(16):
        text = secret if number == 0 else f"Order ORD-{100 + number}: " + "words " * 300
        proxy.provider.script.append(Reply(text=f"Noted {number}."))
        await client.responses.create(model="gpt-4o", input=text, conversation=conversation_id)
    sent = json.dumps(proxy.provider.model_requests[-1].json["input"])
    assert "PO box 4471" in sent and "summary" in sent  # cut, the rule in the summary
    [first] = [i for i in await listed(proxy, conversation_id, order="asc")][:1]
    await client.conversations.items.delete(first["id"], conversation_id=conversation_id)
    proxy.provider.script.append(Reply(text="Noted."))
    await client.responses.create(model="gpt-4o", input="Next?", conversation=conversation_id)
    assert "PO box 4471" not in json.dumps(proxy.provider.model_requests[-1].json["input"])
