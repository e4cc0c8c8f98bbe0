"""Prefix reuse through the proxy (issue 22, item 6): when a stateless agent's history
outgrows its window, the provider first receives the newest tool results compressed and
the older ones as they were sent before, so its prompt cache keeps the prefix up to them."""

from __future__ import annotations

import json
from typing import Any


def turn(n: int) -> list[dict[str, Any]]:
    """A question answered through one lookup with a large result (about 900 tokens)."""
    rows = [
        {"order": f"ORD-{n}-{i}", "status": "shipped", "note": "lorem ipsum " * 6}
        for i in range(30)
    ]
    function = {"name": "lookup_orders", "arguments": json.dumps({"batch": n})}
    return [
        {"role": "user", "content": f"Check batch {n}."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": f"call_{n}", "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": f"call_{n}", "content": json.dumps(rows)},
        {"role": "assistant", "content": f"Batch {n} is shipped."},
    ]


def compressed(messages: list[dict[str, Any]]) -> list[str]:
    return [
        m["tool_call_id"]
        for m in messages
        if m["role"] == "tool" and "threadkeeper_compressed" in m["content"]
    ]


async def test_the_first_compression_rewrites_the_newest_results_only(make_proxy) -> None:  # type: ignore[no-untyped-def]
    proxy = await make_proxy(window=8000)
    client = proxy.client()
    history: list[dict[str, Any]] = [{"role": "system", "content": "You track orders."}]
    previous: list[dict[str, Any]] = []
    for n in range(12):
        history += turn(n)
        messages = [*history, {"role": "user", "content": "Anything late?"}]
        await client.chat.completions.create(model="gpt-4o", messages=messages)
        sent = proxy.provider.model_requests[-1].json["messages"]
        if compressed(sent):
            break
        previous = sent
    else:
        raise AssertionError("the history never outgrew the window")
    names = compressed(sent)
    # The newest results, as the replayed cut compressed them when the history first
    # overflowed (the request that brought call_{n}'s result): not the oldest one.
    assert names == [f"call_{k}" for k in range(n - len(names), n)], names
    assert "call_0" not in names
    first = next(i for i, m in enumerate(sent) if m.get("tool_call_id") == names[0])
    # Everything before the first compressed result is what the provider got last time.
    assert sent[:first] == previous[:first]
    assert len(sent) == len(messages)  # compressed in place, nothing cut
