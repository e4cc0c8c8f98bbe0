"""`threadkeeper demo`: the proxy against a scripted provider on loopback, driven by the
openai SDK like a real agent, printing what each turn sends and what was trimmed.

Runs with no internet and no keys, so a newcomer sees the budgeted rebuild work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import openai

from proxy.admin import token_bar_text
from proxy.fake_provider import FakeProvider, Reply
from proxy.logs import configure_logging
from proxy.server.app import bound_port, start
from proxy.settings import Settings

DEMO_KEY = "sk-demo"
DEMO_THREAD = "demo-thread"
DEMO_POLICY = """\
tenant: default
allow_unknown_keys: true
models:
  "*": {{context_window: {window}, max_output_tokens: 1000}}
budget: {{reserve_output_tokens: 500, safety_margin_tokens: 100}}
memory:
  keep_recent_turns: 2
  tool_result_max_tokens: 150
  pin_patterns: ["(?i)all prices in"]
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "description": "Look up an order by id.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "description": "Order id"}},
                "required": ["order_id"],
            },
        },
    }
]


def order_record(n: int) -> str:
    """A deliberately bulky tool result, like a real order service returns."""
    return json.dumps(
        {
            "order_id": f"ORD-{1000 + n}",
            "status": "shipped",
            "tracking_no": f"YT{123456 + n}",
            "events": [
                {"at": f"2026-09-0{1 + i % 9}T10:{i:02d}:00Z", "note": f"scan {i} at hub {i % 7}"}
                for i in range(40)
            ],
        }
    )


async def _drive(policies: Path, turns: int, window: int, serve: bool) -> None:
    provider = FakeProvider()
    upstream_url = await provider.start()
    settings = Settings(
        port=0,
        policies_dir=policies,
        store_url=f"sqlite:///{policies / 'demo.db'}",
        upstream_url=upstream_url,
        policy_reload_interval=0,
        operator_token=secrets.token_urlsafe(18) if serve else None,
    )
    runner = await start(settings)
    base_url = f"http://127.0.0.1:{bound_port(runner)}"
    try:
        client = openai.AsyncOpenAI(
            base_url=f"{base_url}/v1",
            api_key=DEMO_KEY,
            default_headers={"X-Thread-Id": DEMO_THREAD},
        )
        last_request = await _conversation(client, provider, turns, window)
        await client.close()
        await _what_the_model_saw(base_url, last_request)
        if serve:
            print(f"\nThe inspector is at {base_url}/threadkeeper/ui/")
            print(f"Sign in with the operator token {settings.operator_token}")
            # The store is temporary: the command works only while the demo runs.
            print("While the demo runs, the same from a shell:")
            print(f"  threadkeeper threads explain {last_request} --store {settings.store_url}")
            print(f"(the demo thread is {DEMO_THREAD}; Ctrl-C stops the demo)", flush=True)
            await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await provider.stop()


async def _conversation(
    client: openai.AsyncOpenAI, provider: FakeProvider, turns: int, window: int
) -> str:
    """Drives the agent; the request id of its last model request."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an order assistant."},
        {
            "role": "user",
            "content": "All prices in CNY, tax included. Never refund without asking.",
        },
        {"role": "assistant", "content": "Understood."},
    ]
    print(f"threadkeeper demo: {window}-token window, {turns} agent turns, scripted provider")
    print(f"{'turn':>4} {'client msgs':>11} {'sent msgs':>9} {'sent tokens':>11}  trimmed")
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Where is order ORD-{1000 + turn}?"})
        provider.script.append(
            Reply(tool_calls=[("get_order", json.dumps({"order_id": f"ORD-{1000 + turn}"}))])
        )
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
        )
        completion = raw.parse()
        call = completion.choices[0].message.tool_calls[0]  # type: ignore[index]
        messages.append(completion.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": order_record(turn)})
        provider.script.append(Reply(text=f"Order ORD-{1000 + turn} has shipped."))
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
        )
        answer = raw.parse().choices[0].message
        messages.append({"role": "assistant", "content": answer.content})
        sent = provider.requests[-1].json or {}
        _check_sent(
            sent.get("messages", []), int(raw.headers["x-threadkeeper-context-tokens"]), window
        )
        print(
            f"{turn:>4} {len(messages) - 1:>11} {len(sent.get('messages', [])):>9} "
            f"{raw.headers.get('x-threadkeeper-context-tokens', '?'):>11}  "
            f"{raw.headers.get('x-threadkeeper-trimmed', '')}"
        )
    print("every request fit the window; every tool call went out with its result.")
    return raw.headers["x-threadkeeper-request-id"]


async def _what_the_model_saw(base_url: str, request_id: str) -> None:
    """The last request's explain record, as a token bar and the summary it sent."""
    url = f"{base_url}/threadkeeper/v1/requests/{request_id}"
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers={"Authorization": f"Bearer {DEMO_KEY}"}) as response:
            record = await response.json()
    print("\nWhat the model saw on the last turn:")
    print(token_bar_text(record["projection"]))
    for stand_in in record["stand_ins"]:
        if stand_in["kind"] == "summary":
            print("\nThe summary that stands for the dropped turns:")
            print(stand_in["text"])


def _check_sent(messages: list[dict[str, Any]], tokens: int, window: int) -> None:
    """The demo's claim, checked on what the provider actually received."""
    calls = {c["id"] for m in messages for c in m.get("tool_calls") or []}
    outputs = {m["tool_call_id"] for m in messages if m.get("role") == "tool"}
    if calls != outputs or tokens > window:
        raise SystemExit(f"broken request sent: calls={calls} outputs={outputs} tokens={tokens}")


def run_demo(turns: int = 8, window: int = 3000, serve: bool = False) -> int:
    """`serve`: keep the proxy running afterwards with the thread inspector on."""
    configure_logging("warning")  # keep the table readable; `serve` logs every request
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "default.yaml").write_text(DEMO_POLICY.format(window=window))
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_drive(Path(tmp), turns, window, serve))
    return 0
