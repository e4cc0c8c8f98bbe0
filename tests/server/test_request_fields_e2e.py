"""Every field of OpenAI's CreateResponse survives a rebuilt turn (issue 24, item 5): read
from the spec (tests/reliability/openai-subset.json, cut from the OpenAPI document), each
is either forwarded to the provider unchanged on a stateful turn (`previous_response_id`
and `conversation`), or served by the proxy by design (docs/request-fields.md). A field
the spec adds fails `test_the_lists_cover_create_response` until it is placed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from .conftest import Proxy

SPEC = Path(__file__).resolve().parents[1] / "reliability" / "openai-subset.json"
DOC = Path(__file__).resolve().parents[2] / "docs" / "request-fields.md"

# Forwarded as the client sent them, with a value of the spec's shape each.
FORWARDED: dict[str, Any] = {
    "model": "gpt-4o",
    "instructions": "Answer in French.",
    "include": ["message.output_text.logprobs"],
    "max_output_tokens": 900,
    "max_tool_calls": 4,
    "metadata": {"team": "search"},
    "moderation": {"model": "omni-moderation-latest"},
    "parallel_tool_calls": False,
    "prompt": {"id": "pmpt_abc", "version": "2", "variables": {"city": "Lyon"}},
    "prompt_cache_key": "acme-thread-7",
    "prompt_cache_options": {"ttl": "30m", "mode": "explicit"},
    "prompt_cache_retention": "24h",
    "reasoning": {"effort": "low", "summary": "auto"},
    "safety_identifier": "user-hash-42",
    "service_tier": "flex",
    "temperature": 0.3,
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "tool_choice": {"type": "function", "name": "lookup"},
    "tools": [
        {
            "type": "function",
            "name": "lookup",
            "description": "Find an order.",
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
            "strict": False,
        }
    ],
    "top_logprobs": 3,
    "top_p": 0.9,
    "truncation": "auto",
    "user": "legacy-user-id",
}
# Forwarded too, on a streamed turn (stream_options only makes sense with it).
STREAMED: dict[str, Any] = {"stream": True, "stream_options": {"include_obfuscation": False}}
# Served by the proxy, never forwarded as given (docs/request-fields.md says how).
SERVED = frozenset(
    {
        "input",
        "conversation",
        "previous_response_id",
        "store",
        "context_management",
        "background",
    }
)


def create_response_properties() -> set[str]:
    """CreateResponse's properties, its allOf parts resolved."""
    schemas = json.loads(SPEC.read_text())["components"]["schemas"]

    def properties(name: str) -> set[str]:
        schema = schemas[name]
        found: set[str] = set()
        for part in [*schema.get("allOf", ()), schema]:
            if "$ref" in part:
                found |= properties(part["$ref"].rsplit("/", 1)[-1])
            else:
                found |= set(part.get("properties", {}))
        return found

    return properties("CreateResponse")


def test_the_lists_cover_create_response() -> None:
    spec = create_response_properties()
    placed = set(FORWARDED) | set(STREAMED) | SERVED
    assert spec - placed == set(), "a CreateResponse field is neither forwarded nor served"
    assert placed - spec == set(), "a listed field is not in CreateResponse"
    assert len(spec) >= 30  # the resolution found the spec's fields, not an empty set


def test_the_doc_lists_every_field_served_by_the_proxy() -> None:
    text = DOC.read_text()
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.M))
    assert rows == SERVED | set(FORWARDED) | set(STREAMED)


async def stateful_turn(proxy: Proxy, mode: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A first turn, then a second one of `mode` with `fields`: the provider's request."""
    client = proxy.client()
    extra = {k: v for k, v in fields.items() if k not in ("model", "stream")}
    if mode == "conversation":
        conversation = await client.conversations.create(
            items=[{"role": "user", "content": "Find ORD-1."}]  # type: ignore[list-item]
        )
        state: dict[str, Any] = {"conversation": conversation.id}
    else:
        first = await client.responses.create(model="gpt-4o", input="Find ORD-1.")
        state = {"previous_response_id": first.id}
    if fields.get("stream"):
        async with await client.responses.create(
            model="gpt-4o", input="And ORD-2?", stream=True, extra_body=extra, **state
        ) as stream:
            async for _ in stream:
                pass
    else:
        await client.responses.create(
            model=fields["model"], input="And ORD-2?", extra_body=extra, **state
        )
    sent = proxy.provider.model_requests[-1].json
    assert isinstance(sent, dict)
    return sent


@pytest.mark.parametrize("mode", ["previous_response_id", "conversation"])
async def test_every_non_history_field_reaches_the_provider_unchanged(
    proxy: Proxy, mode: str
) -> None:
    sent = await stateful_turn(proxy, mode, FORWARDED)
    for name, value in FORWARDED.items():
        assert sent.get(name) == value, name
    # Served here: the provider gets a stateless request of the rebuilt history.
    assert "conversation" not in sent and "previous_response_id" not in sent
    assert sent["store"] is False
    texts = [item.get("content") for item in sent["input"]]
    assert texts[0] == "Find ORD-1." and texts[-1] == "And ORD-2?"


@pytest.mark.parametrize("mode", ["previous_response_id", "conversation"])
async def test_stream_fields_reach_the_provider_unchanged(proxy: Proxy, mode: str) -> None:
    sent = await stateful_turn(proxy, mode, {"model": "gpt-4o", **STREAMED})
    for name, value in STREAMED.items():
        assert sent.get(name) == value, name


async def test_context_management_is_served_here_not_forwarded(proxy: Proxy) -> None:
    context = [{"type": "compaction", "compact_threshold": 100000}]
    sent = await stateful_turn(
        proxy, "previous_response_id", {"model": "gpt-4o", "context_management": context}
    )
    assert "context_management" not in sent
