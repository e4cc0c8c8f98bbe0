"""A value a later turn names, from a stored thread's older summary chain (issue 22, item
3): the window starts at the cut, so the items the chain stands for are read from the
store (turn.chain_sources) when a turn names what the chain lacks, by a proxy that never
held them (a restart, another worker)."""

from __future__ import annotations

import json
from typing import Any

from proxy.core.memory import SUMMARY_MARKER
from proxy.fake_provider import Reply
from proxy.server.state import STORE, THREADS
from proxy.threads import MEMO_BYTES
from tests.core.test_salience import manifest

from .conftest import Proxy, ProxyFactory

THREAD = {"X-Thread-Id": "infra-1"}
NAMED = "CACHE_TTL_17"


def tool_turn(n: int, args: str, result: str) -> list[dict[str, Any]]:
    call = {"id": f"c{n}", "type": "function", "function": {"name": "kubectl"}}
    call["function"]["arguments"] = json.dumps({"args": args})  # type: ignore[index]
    return [
        {"role": "user", "content": f"Step {n}: run kubectl {args}."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{n}", "content": result},
    ]


def events(n: int) -> str:
    return "\n".join(
        f"Event {i} pod ledger-{n}: Normal Pulled image ok node-{i % 3}" for i in range(60)
    )


async def test_a_value_named_after_its_turn_left_the_window_reaches_the_provider(
    make_proxy: ProxyFactory, tmp_path: Any
) -> None:
    url = f"sqlite:///{tmp_path / 'chain.db'}"
    first: Proxy = await make_proxy(window=5200, store_url=url)
    client = first.client()
    system = {"role": "system", "content": "You are an infra agent."}
    turns = [tool_turn(0, "get deploy ledger -o yaml", manifest())]
    turns += [tool_turn(n, f"describe pod ledger-{n}", events(n)) for n in range(1, 13)]
    for n, messages in enumerate(turns):
        first.provider.script.append(Reply(text=f"Step {n} done: it looks fine."))
        await client.chat.completions.create(
            model="gpt-4o",
            messages=[system, *messages] if n == 0 else messages,  # type: ignore[arg-type]
            extra_headers=THREAD,
        )
    thread = await first.app[STORE].get_thread("acme", "infra-1")  # type: ignore[index]
    assert thread is not None and thread.state["window_start"] > 4  # the manifest turn cut
    chain = "\n".join(str(s["raw"].get("content")) for s in thread.state["summary"])
    assert SUMMARY_MARKER in chain and NAMED not in chain
    # Another proxy on the same store (a restart, another worker) gets the naming turn.
    second: Proxy = await make_proxy(window=5200, store_url=url)
    second.provider.script.append(Reply(text="Raised."))
    await second.client().chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": f"Why is `{NAMED}` set at all?"}],
        extra_headers=THREAD,
    )
    sent = second.provider.model_requests[-1].json["messages"]
    text = "\n".join(str(m.get("content")) for m in sent)
    assert f"name: {NAMED}" in text
    after = await second.app[STORE].get_thread("acme", "infra-1")  # type: ignore[index]
    assert after is not None and after.state["window_start"] == thread.state["window_start"]
    # The rows read are kept with the window and counted in the cache's bound.
    cache = second.app[THREADS].cache
    held = cache.get("acme", "infra-1")
    assert held is not None and held.memo[MEMO_BYTES] > 0
    assert cache.bytes == sum(held.sizes) + held.memo[MEMO_BYTES]
