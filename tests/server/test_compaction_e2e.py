"""OpenAI's compaction served by the proxy over a provider that has none (issue 10, items
5 and 6), through the real socket with the real `openai` SDK: `responses.compact`, the
compaction item sent back (stateless and stateful), `context_management`, the operator
views, and hostile blobs."""

from __future__ import annotations

import base64
import json
from typing import Any

import openai
import pytest

from proxy.core.compaction import BLOB_PREFIX
from proxy.core.memory import SUMMARY_MARKER
from proxy.fake_provider import FakeProvider

from .conftest import Proxy

OTHER_KEY = "sk-tk-globex-test-key"


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
        items.append({"role": "user", "content": f"question {turn}: " + "details " * 40})
        items.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"answer {turn} " + "words " * 60}],
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
