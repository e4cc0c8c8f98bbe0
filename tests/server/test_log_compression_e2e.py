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
