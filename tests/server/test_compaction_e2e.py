"""OpenAI's compaction served by the proxy over a provider that has none (issue 10, items
5 and 6), through the real socket with the real `openai` SDK: `responses.compact`, the
compaction item sent back (stateless and stateful), `context_management`, the operator
views, and hostile blobs."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.cli import main
from proxy.core.compaction import BLOB_PREFIX
from proxy.core.memory import SUMMARY_MARKER
from proxy.fake_provider import FakeProvider
from proxy.server.state import SETTINGS
from proxy.store import open_store

from .conftest import TENANT_KEY, Proxy


def history(
    turns: int, *, fact: str = "order ORD-7731 refunded 129.50 EUR"
) -> list[dict[str, Any]]:
    """A Responses history: user turns, assistant answers, one tool call with its output."""
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "Rules: all prices in EUR, never book red-eye flights."},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": json.dumps({"status": fact}),
        },
    ]
    for turn in range(turns):
        items.append({"role": "user", "content": f"question {turn}?"})
        items.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"answer {turn} " + "words " * 120}],
            }
        )
    return items


def sent_item_types(provider: FakeProvider) -> list[str | None]:
    """Every item type the provider ever received in a Responses input."""
    found = []
    for recorded in provider.model_requests:
        given = (recorded.json or {}).get("input")
        if isinstance(given, list):
            found.extend(item.get("type") for item in given)
    return found


def sent_texts(provider: FakeProvider, index: int = -1) -> str:
    return json.dumps(provider.model_requests[index].json)


async def test_compact_returns_user_messages_then_one_sealed_compaction_item(proxy: Proxy) -> None:
    client = proxy.client()
    given = history(3)
    compacted = await client.responses.compact(model="gpt-4o", input=given)  # type: ignore[arg-type]
    assert compacted.object == "response.compaction"
    output = [item.model_dump(exclude_unset=True, warnings=False) for item in compacted.output]
    users = [item for item in given if item.get("role") == "user"]
    assert [o["content"] for o in output[:-1]] == [
        [{"type": "input_text", "text": u["content"]}] for u in users
    ]
    assert all(o["type"] == "message" and o["role"] == "user" for o in output[:-1])
    item = output[-1]
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert item["encrypted_content"].startswith(BLOB_PREFIX)
    assert "ORD-7731" not in item["encrypted_content"]  # sealed, not encoded
    assert compacted.usage.input_tokens > 0 and compacted.usage.output_tokens > 0
    assert (
        compacted.usage.total_tokens == compacted.usage.input_tokens + compacted.usage.output_tokens
    )
    # The same conversation compacts to the same item (stable id and bytes).
    again = await client.responses.compact(model="gpt-4o", input=given)  # type: ignore[arg-type]
    assert again.output[-1].model_dump(exclude_unset=True, warnings=False) == item
    assert proxy.provider.model_requests == []  # served locally


async def test_continuing_after_compact_sends_the_summary_as_text_never_the_item(
    proxy: Proxy,
) -> None:
    client = proxy.client()
    compacted = await client.responses.compact(model="gpt-4o", input=history(4))  # type: ignore[arg-type]
    new_message = {"role": "user", "content": "What was refunded?"}
    answer = await client.responses.create(
        model="gpt-4o",
        input=[
            *[o.model_dump(exclude_unset=True, warnings=False) for o in compacted.output],
            new_message,
        ],  # type: ignore[list-item]
        store=False,
    )
    assert answer.output_text
    assert "compaction" not in sent_item_types(proxy.provider)
    sent = proxy.provider.model_requests[-1].json
    developer = [i for i in sent["input"] if i.get("role") == "developer"]
    assert len(developer) == 1 and developer[0]["content"].startswith(SUMMARY_MARKER)
    assert "ORD-7731" in developer[0]["content"]  # the tool fact survived the compaction
    assert "encrypted_content" not in json.dumps(sent)
    assert sent["input"][-1] == new_message


async def test_a_tampered_blob_is_a_400_naming_the_input(proxy: Proxy) -> None:
    client = proxy.client()
    compacted = await client.responses.compact(model="gpt-4o", input=history(1))  # type: ignore[arg-type]
    output = [o.model_dump(exclude_unset=True, warnings=False) for o in compacted.output]
    blob = output[-1]["encrypted_content"]
    raw = bytearray(base64.urlsafe_b64decode(blob[len(BLOB_PREFIX) :]))
    raw[20] ^= 1
    output[-1]["encrypted_content"] = BLOB_PREFIX + base64.urlsafe_b64encode(bytes(raw)).decode()
    index = len(output) - 1
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(
            model="gpt-4o", input=[*output, {"role": "user", "content": "hi"}]
        )  # type: ignore[list-item]
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == f"input[{index}].encrypted_content"
    assert error["code"] == "invalid_encrypted_content"
    assert proxy.provider.model_requests == []


CONTEXT = [{"type": "compaction", "compact_threshold": 1000}]


@pytest.mark.parametrize("store", [False, True])
async def test_context_management_compacts_a_stateless_turn_over_the_threshold(
    proxy: Proxy, store: bool
) -> None:
    client = proxy.client()
    given = [*history(12), {"role": "user", "content": "And now?"}]
    answer = await client.responses.create(
        model="gpt-4o",
        input=given,
        store=store,
        extra_body={"context_management": CONTEXT},  # type: ignore[arg-type]
    )
    output = [o.model_dump(exclude_unset=True, warnings=False) for o in answer.output]
    assert output[0]["type"] == "compaction" and output[0]["id"].startswith("cmp_")
    assert output[1]["type"] == "message" and answer.output_text
    sent = proxy.provider.model_requests[-1].json
    assert "context_management" not in sent
    assert "compaction" not in sent_item_types(proxy.provider)
    types = [(i.get("type"), i.get("role")) for i in sent["input"]]
    assert ("message", "assistant") not in types  # the answers are in the summary now
    assert "function_call" not in [t for t, _ in types]
    assert sum(1 for _, role in types if role == "user") == 14  # every user message, verbatim
    assert sent["input"][-1] == given[-1]
    assert "ORD-7731" in json.dumps(sent["input"])

    # The client sends it all back (OpenAI's stateless contract): the items the compaction
    # stands for are not sent again, and no second compaction is needed.
    follow = [*given, *output, {"role": "user", "content": "Thanks. Total?"}]
    second = await client.responses.create(
        model="gpt-4o",
        input=follow,
        store=store,
        extra_body={"context_management": CONTEXT},  # type: ignore[arg-type]
    )
    assert [o.type for o in second.output] == ["message"]
    resent = proxy.provider.model_requests[-1].json["input"]
    assert [i.get("role") for i in resent].count("developer") == 1
    assert [i.get("role") for i in resent].count("assistant") == 1  # only the answer after it
    assert "compaction" not in sent_item_types(proxy.provider)


async def test_context_management_under_the_threshold_changes_nothing_but_the_field(
    proxy: Proxy,
) -> None:
    client = proxy.client()
    given = [{"role": "user", "content": "short"}]
    answer = await client.responses.create(
        model="gpt-4o",
        input=given,
        store=False,
        extra_body={"context_management": CONTEXT},  # type: ignore[arg-type]
    )
    assert [o.type for o in answer.output] == ["message"]
    sent = proxy.provider.model_requests[-1].json
    assert sent["input"] == given and "context_management" not in sent


async def test_context_management_in_a_stream_emits_the_item_first(proxy: Proxy) -> None:
    client = proxy.client()
    given = [*history(12), {"role": "user", "content": "And now?"}]
    events = []
    async with await client.responses.create(
        model="gpt-4o",
        input=given,  # type: ignore[arg-type]
        store=False,
        stream=True,
        extra_body={"context_management": CONTEXT},
    ) as stream:
        async for event in stream:
            events.append(event)
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert added[0].item.type == "compaction" and added[0].output_index == 0
    assert done[0].item.type == "compaction" and done[0].output_index == 0
    assert added[1].item.type == "message" and added[1].output_index == 1
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    completed = events[-1]
    assert completed.type == "response.completed"
    assert [o.type for o in completed.response.output] == ["compaction", "message"]
    assert completed.response.output[0].id == added[0].item.id
    assert "compaction" not in sent_item_types(proxy.provider)


async def test_a_stateful_thread_keeps_the_compaction(proxy: Proxy) -> None:
    client = proxy.client()
    first = await client.responses.create(model="gpt-4o", input=history(12))  # type: ignore[arg-type]
    second = await client.responses.create(
        model="gpt-4o",
        previous_response_id=first.id,
        input="Where are we?",
        extra_body={"context_management": CONTEXT},
    )
    assert [o.type for o in second.output] == ["compaction", "message"]
    sent = proxy.provider.model_requests[-1].json
    assert "compaction" not in sent_item_types(proxy.provider)
    roles = [i.get("role") for i in sent["input"]]
    assert "assistant" not in roles and roles.count("developer") == 1
    stored = await client.responses.retrieve(second.id)
    assert [o.type for o in stored.output] == ["compaction", "message"]

    # Later turns read the kept compaction: its summary, not the items it stands for.
    third = await client.responses.create(
        model="gpt-4o", previous_response_id=second.id, input="And the refund?"
    )
    assert [o.type for o in third.output] == ["message"]
    sent = proxy.provider.model_requests[-1].json
    roles = [i.get("role") for i in sent["input"]]
    assert roles.count("developer") == 1 and roles.count("assistant") == 1
    assert "ORD-7731" in json.dumps(sent["input"])
    assert "compaction" not in sent_item_types(proxy.provider)


async def test_compact_a_stored_chain_by_previous_response_id(proxy: Proxy) -> None:
    client = proxy.client()
    first = await client.responses.create(model="gpt-4o", input=history(3))  # type: ignore[arg-type]
    second = await client.responses.create(
        model="gpt-4o", previous_response_id=first.id, input="One more thing: ship to Lyon."
    )
    compacted = await client.responses.compact(model="gpt-4o", previous_response_id=second.id)
    output = [o.model_dump(exclude_unset=True, warnings=False) for o in compacted.output]
    texts = [part["text"] for o in output[:-1] for part in o["content"]]
    assert texts[-1] == "One more thing: ship to Lyon." and len(texts) == 5  # every user turn
    assert output[-1]["type"] == "compaction"
    # The same conversation given as input compacts to the same item.
    items = [
        i.model_dump(exclude_unset=True, warnings=False)
        for i in (await client.responses.input_items.list(first.id, order="asc")).data
    ]
    assert len(items) == len(history(3))
    calls = len(proxy.provider.model_requests)
    continued = await client.responses.create(
        model="gpt-4o", input=[*output, {"role": "user", "content": "Where to?"}], store=False
    )
    assert continued.output_text and len(proxy.provider.model_requests) == calls + 1
    sent = json.dumps(proxy.provider.model_requests[-1].json)
    assert "ORD-7731" in sent and "Lyon" in sent and '"compaction"' not in sent


async def test_operators_read_a_compaction_by_endpoint_and_cli(
    proxy: Proxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = proxy.client()
    compacted = await client.responses.compact(model="gpt-4o", input=history(2))  # type: ignore[arg-type]
    item = compacted.output[-1].model_dump(exclude_unset=True, warnings=False)
    async with proxy.http() as http:
        response = await http.post(
            "/threadkeeper/v1/compactions/open",
            json={"encrypted_content": item["encrypted_content"]},
            headers={"Authorization": f"Bearer {TENANT_KEY}"},
        )
    assert response.status_code == 200, response.text
    shown = response.json()
    assert shown["object"] == "threadkeeper.compaction" and shown["id"] == item["id"]
    assert shown["tenant"] == "acme" and shown["covers"] == 4  # the call, its output, two answers
    assert shown["text"].startswith(SUMMARY_MARKER) and "ORD-7731" in shown["text"]
    assert shown["summary"]["format"] == "memory"

    store = f"sqlite:///{proxy.app[SETTINGS].store_url.removeprefix('sqlite:///')}"  # type: ignore[index]
    blob = item["encrypted_content"]
    answer_file = tmp_path / "compacted.json"
    answer_file.write_text(compacted.model_dump_json(warnings=False))
    cli = ["compaction", "show", "--tenant", "acme", "--store", store]
    capsys.readouterr()  # the proxy's request log lines so far
    assert await asyncio.to_thread(main, [*cli, "--json", blob]) == 0
    assert json.loads(capsys.readouterr().out) == shown
    assert await asyncio.to_thread(main, [*cli, str(answer_file)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"compaction {item['id']}  tenant acme  covers 4 items\n")
    assert "ORD-7731" in out

    wrong = ["compaction", "show", "--tenant", "globex", "--store", store, blob]
    assert await asyncio.to_thread(main, wrong) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "could not be verified" in error[0]
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    assert await asyncio.to_thread(main, [*cli[:4], "--store", empty, blob]) == 2
    assert "there is no store at" in capsys.readouterr().err  # and none is made
    store_without_key = await open_store(empty)
    await store_without_key.migrate()
    await store_without_key.close()
    assert await asyncio.to_thread(main, [*cli[:4], "--store", empty, blob]) == 2
    assert "compaction key" in capsys.readouterr().err


UPSTREAM_MODE = "compaction: {mode: upstream}\n"


async def test_upstream_mode_passes_compaction_through_untouched(make_proxy) -> None:  # type: ignore[no-untyped-def]
    proxy = await make_proxy(acme_extra=UPSTREAM_MODE)
    async with proxy.http() as http:
        auth = {"Authorization": f"Bearer {TENANT_KEY}"}
        body = {"model": "gpt-4o", "input": history(1)}
        compact = await http.post("/v1/responses/compact", json=body, headers=auth)
        assert compact.status_code == 200
        assert compact.json()["path"] == "/v1/responses/compact"  # the fake provider's echo
        item = {"type": "compaction", "id": "cmp_x", "encrypted_content": "gAAAAABopaque=="}
        given = {
            "model": "gpt-4o",
            "input": [item, {"role": "user", "content": "hi"}],
            "store": False,
            "context_management": CONTEXT,
        }
        answer = await http.post("/v1/responses", json=given, headers=auth)
        assert answer.status_code == 200, answer.text
    sent = proxy.provider.model_requests[-1].json
    assert sent["input"][0] == item and sent["context_management"] == CONTEXT


async def test_a_configured_key_is_shared_by_proxies_on_other_stores(make_proxy) -> None:  # type: ignore[no-untyped-def]
    key = {"compaction_key": bytes(range(32))}
    one, two = await make_proxy(settings=key), await make_proxy(settings=key)
    other = await make_proxy(settings={"compaction_key": bytes(32)})
    compacted = await one.client().responses.compact(model="gpt-4o", input=history(1))  # type: ignore[arg-type]
    output = [o.model_dump(exclude_unset=True, warnings=False) for o in compacted.output]
    follow = [*output, {"role": "user", "content": "next"}]
    answer = await two.client().responses.create(model="gpt-4o", input=follow, store=False)  # type: ignore[arg-type]
    assert answer.output_text
    with pytest.raises(openai.BadRequestError):
        await other.client().responses.create(model="gpt-4o", input=follow, store=False)  # type: ignore[arg-type]


async def test_a_conversation_holds_a_compaction_and_sends_its_summary(proxy: Proxy) -> None:
    client = proxy.client()
    compacted = await client.responses.compact(model="gpt-4o", input=history(3))  # type: ignore[arg-type]
    output = [o.model_dump(exclude_unset=True, warnings=False) for o in compacted.output]
    conversation = await client.conversations.create(items=output)  # type: ignore[arg-type]
    answer = await client.responses.create(
        model="gpt-4o", conversation=conversation.id, input="What was refunded?"
    )
    assert answer.output_text
    sent = proxy.provider.model_requests[-1].json
    assert "compaction" not in sent_item_types(proxy.provider)
    assert "ORD-7731" in json.dumps(sent["input"])
    # A forged one is refused when it comes in, not on every later turn.
    forged = {**output[-1], "encrypted_content": output[-1]["encrypted_content"][:-8] + "AAAAAAA="}
    async with proxy.http() as http:
        refused = await http.post(
            f"/v1/conversations/{conversation.id}/items",
            json={"items": [forged]},
            headers={"Authorization": f"Bearer {TENANT_KEY}"},
        )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "items[0].encrypted_content"


async def test_a_streamed_stateful_turn_keeps_the_compaction_it_made(proxy: Proxy) -> None:
    client = proxy.client()
    first = await client.responses.create(model="gpt-4o", input=history(12))  # type: ignore[arg-type]
    async with await client.responses.create(
        model="gpt-4o",
        previous_response_id=first.id,
        input="Where are we?",
        stream=True,
        extra_body={"context_management": CONTEXT},
    ) as stream:
        events = [event async for event in stream]
    completed = events[-1]
    assert completed.type == "response.completed"
    assert [o.type for o in completed.response.output] == ["compaction", "message"]
    stored = await client.responses.retrieve(completed.response.id)
    assert [o.type for o in stored.output] == ["compaction", "message"]
    third = await client.responses.create(
        model="gpt-4o", previous_response_id=completed.response.id, input="And then?"
    )
    assert [o.type for o in third.output] == ["message"]
    roles = [i.get("role") for i in proxy.provider.model_requests[-1].json["input"]]
    assert roles.count("developer") == 1 and roles.count("assistant") == 1
    assert "compaction" not in sent_item_types(proxy.provider)


async def test_input_tokens_counts_a_compaction_as_the_summary_sent(proxy: Proxy) -> None:
    client = proxy.client()
    compacted = await client.responses.compact(model="gpt-4o", input=history(3))  # type: ignore[arg-type]
    output = [o.model_dump(exclude_unset=True, warnings=False) for o in compacted.output]
    async with proxy.http() as http:
        auth = {"Authorization": f"Bearer {TENANT_KEY}"}
        shown = await http.post(
            "/threadkeeper/v1/compactions/open",
            json={"encrypted_content": output[-1]["encrypted_content"]},
            headers=auth,
        )
        text = shown.json()["text"]
        question = {"role": "user", "content": "Total?"}
        counts = []
        for given in (
            [*output, question],
            [*output[:-1], {"type": "message", "role": "developer", "content": text}, question],
        ):
            body = {"model": "gpt-4o", "input": given}
            response = await http.post("/v1/responses/input_tokens", json=body, headers=auth)
            assert response.status_code == 200, response.text
            counts.append(response.json()["input_tokens"])
    assert counts[0] == counts[1]


async def test_compact_refuses_a_previous_response_whose_thread_is_gone(proxy: Proxy) -> None:
    """`previous_response_id` follows one rule everywhere (modes.previous_response): a
    response whose conversation was deleted continues nothing, so it compacts nothing
    either: both are OpenAI's 400 previous_response_not_found."""
    client = proxy.client()
    conversation = await client.conversations.create()
    answered = await client.responses.create(
        model="gpt-4o", conversation=conversation.id, input="Ship order ORD-7731 to Lyon."
    )
    await client.conversations.delete(conversation.id)
    with pytest.raises(openai.BadRequestError) as continued:
        await client.responses.create(
            model="gpt-4o", previous_response_id=answered.id, input="And then?"
        )
    with pytest.raises(openai.BadRequestError) as compacted:
        await client.responses.compact(model="gpt-4o", previous_response_id=answered.id)
    for refused in (continued, compacted):
        assert refused.value.code == "previous_response_not_found"
