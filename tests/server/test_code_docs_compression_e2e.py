"""A file listing and a web page through the proxy (issue 22, item 4): once the thread
outgrows its window, the provider still receives the listing's line the assistant named
by its number and the page's sentence carrying the search query's terms."""

from __future__ import annotations

import json
from typing import Any

from tests.core.test_code_docs import ANSWER, BUG, source_file, web_page


def turn(call_id: str, name: str, arguments: dict[str, Any], content: str, said: str) -> list[Any]:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return [
        {"role": "user", "content": f"Please run {name}."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": content},
        {"role": "assistant", "content": said},
    ]


def history(turns: int) -> list[dict[str, Any]]:
    lines, at = source_file(11)
    numbered = "\n".join(f"{n + 1:6d}\t{line}" for n, line in enumerate(lines))
    query = {"query": "X200 headphones warranty period"}
    messages = turn(
        "call_src", "read_file", {"path": "billing.py"}, numbered, f"Line {at + 1} is wrong."
    )
    messages += turn("call_web", "web_search", query, web_page(12), "I read the help page.")
    for step in range(turns):
        messages += [
            {"role": "user", "content": f"Step {step}: " + "describe the rollout plan " * 40},
            {"role": "assistant", "content": f"Step {step} noted. " + "the plan holds " * 40},
        ]
    return [*messages, {"role": "user", "content": "Fix it and answer the customer."}]


async def test_named_listing_line_and_query_sentence_reach_the_provider(make_proxy) -> None:  # type: ignore[no-untyped-def]
    proxy = await make_proxy(window=6000)
    client = proxy.client()
    compressed: set[str] = set()
    for turns in (1, 2, 4):
        await client.chat.completions.create(model="gpt-4o", messages=history(turns))
        sent = proxy.provider.model_requests[-1].json["messages"]
        for message in sent:
            if message["role"] == "tool" and "threadkeeper_compressed" in message["content"]:
                compressed.add(message["tool_call_id"])
                shown = json.loads(message["content"])["excerpt"]
                assert (BUG if message["tool_call_id"] == "call_src" else ANSWER) in shown, turns
    assert compressed == {"call_src", "call_web"}
