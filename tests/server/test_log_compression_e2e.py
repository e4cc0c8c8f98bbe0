"""A long log answer through the proxy (issue 22, item 1): once the thread outgrows its
window, the provider still receives the one rare failure among the routine errors, in the
compressed tool result and later in the summary."""

from __future__ import annotations

import json
from typing import Any

from tests.core.test_templates import RARE, incident_log


def history(turns: int, seed: int) -> list[dict[str, Any]]:
    function = {"name": "query_logs", "arguments": json.dumps({"level": "WARN"})}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Why is checkout failing since 10:00?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_logs", "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": "call_logs", "content": incident_log(seed)},
        {"role": "assistant", "content": "I am reading the log."},
    ]
    for turn in range(turns):
        messages += [
            {"role": "user", "content": f"Step {turn}: " + "describe the rollout plan " * 40},
            {"role": "assistant", "content": f"Step {turn} noted. " + "the plan holds " * 40},
        ]
    return [*messages, {"role": "user", "content": "What explains the incident?"}]


async def test_the_rare_log_line_reaches_the_provider_after_compression(make_proxy) -> None:  # type: ignore[no-untyped-def]
    proxy = await make_proxy(window=6000)
    client = proxy.client()
    compressed = 0
    for seed, turns in ((1, 2), (2, 4), (3, 8), (4, 16)):
        await client.chat.completions.create(model="gpt-4o", messages=history(turns, seed))
        sent = proxy.provider.model_requests[-1].json["messages"]
        texts = [m["content"] for m in sent if isinstance(m.get("content"), str)]
        assert any(RARE in text for text in texts), f"rare line lost with {turns} turns"
        for message in sent:
            if message["role"] == "tool" and "threadkeeper_compressed" in message["content"]:
                compressed += 1
                assert RARE in json.loads(message["content"])["excerpt"]
    assert compressed, "the log was never compressed"


def structured_history(turns: int) -> list[dict[str, Any]]:
    """A JSON list with one odd amount, then a file listing whose buggy line the assistant
    names in the same turn, then routine turns."""
    from tests.core.test_salience import BUG, SAID, listing
    from tests.core.test_shapes import invoices

    rows = invoices(300, 4)
    rows[123]["amount"] = 14250.0

    def turn(call_id: str, name: str, content: str, said: str) -> list[dict[str, Any]]:
        function = {"name": name, "arguments": "{}"}
        return [
            {"role": "user", "content": f"Run {name}."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": function}],
            },
            {"role": "tool", "tool_call_id": call_id, "content": content},
            {"role": "assistant", "content": said},
        ]

    assert BUG
    messages = turn("call_inv", "list_invoices", json.dumps(rows), "Listed.")
    messages += turn("call_src", "read_file", listing(), SAID)
    for step in range(turns):
        messages += [
            {"role": "user", "content": f"Step {step}: " + "describe the rollout plan " * 40},
            {"role": "assistant", "content": f"Step {step} noted. " + "the plan holds " * 40},
        ]
    return [*messages, {"role": "user", "content": "Fix it."}]


async def test_outliers_and_named_lines_reach_the_provider_after_compression(make_proxy) -> None:  # type: ignore[no-untyped-def]
    """In every request, whether the turns are compressed or summarized: the odd amount
    of the list and the line the assistant named."""
    from tests.core.test_salience import BUG

    proxy = await make_proxy(window=6000)
    client = proxy.client()
    compressed: set[str] = set()
    for turns in (2, 4, 8, 12):
        await client.chat.completions.create(model="gpt-4o", messages=structured_history(turns))
        sent = proxy.provider.model_requests[-1].json["messages"]
        texts = [m["content"] for m in sent if isinstance(m.get("content"), str)]
        assert any("INV-00123=14250" in text for text in texts), turns
        assert any(BUG.strip() in text for text in texts), turns
        for message in sent:
            if message["role"] == "tool" and "threadkeeper_compressed" in message["content"]:
                compressed.add(message["tool_call_id"])
    assert compressed == {"call_inv", "call_src"}
