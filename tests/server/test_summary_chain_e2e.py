"""Issue 10: what stands for the cut history reaches the provider, through the real socket.

A summary is never dropped (a travel thread lost its earlier digest when the recent turns
left it no room, and its summary stood for 4 earlier items instead of 13 from then on),
successive cuts append blocks to a chain whose bytes repeat, and a thread stored before
the chain keeps working."""

from __future__ import annotations

import re
from typing import Any

from proxy.core.items import chat_item
from proxy.core.memory import SUMMARY_MARKER
from proxy.core.tokens import REPLY_PRIMING, TokenCounter
from proxy.fake_provider import Reply
from proxy.server.state import STORE

from .conftest import Proxy, ProxyFactory

THREAD = {"X-Thread-Id": "trip-1"}
COUNT = re.compile(re.escape(SUMMARY_MARKER) + r" Stands for (\d+)")


def summaries(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages if str(m.get("content")).startswith(SUMMARY_MARKER)]


def stands_for(blocks: list[str]) -> int:
    return sum(int(m.group(1)) for b in blocks if (m := COUNT.match(b)))


def reply_words(turn: int) -> int:
    """Replies of very different lengths, so that at some cut the recent turns nearly
    fill the budget (the shape that dropped the summary)."""
    return (40, 600, 90, 1100, 30, 800, 1400, 60)[turn % 8]


async def test_recent_turns_that_fill_the_budget_never_drop_the_summary(
    make_proxy: ProxyFactory,
) -> None:
    """The travel thread of issue 10: after a first cut, two large replies left the
    summary 2 tokens of the history budget; it was dropped, the cut stored without it,
    and every later request lost what it stood for. Here the last request is sized so the
    two recent turns leave exactly 2 tokens."""
    window, output, margin = 5200, 1000, 200  # conftest's acme policy
    # Sized without an opening head (which would give way to the two large turns).
    proxy: Proxy = await make_proxy(window=window, memory_extra=", keep_opening_share: 0")
    client = proxy.client()
    store = proxy.app[STORE]  # type: ignore[index]
    system = {"role": "system", "content": "You are a travel agent."}

    async def ask(content: str, answer: str) -> list[dict[str, Any]]:
        proxy.provider.script.append(Reply(text=answer))
        user = {"role": "user", "content": content}
        first = not proxy.provider.model_requests
        await client.chat.completions.create(
            model="gpt-4o",
            messages=[system, user] if first else [user],  # type: ignore[list-item]
            extra_headers=THREAD,
        )
        return proxy.provider.model_requests[-1].json["messages"]  # type: ignore[no-any-return]

    turn = 0
    while True:  # small turns until the first cut
        sent = await ask(
            f"Q{turn}: hotel {turn} near the station, ref BK-{turn}.", f"Booked {turn}."
        )
        turn += 1
        if summaries(sent):
            break
    earlier = summaries(sent)
    await ask("Which flights?", "Flights: " + "lorem " * 1500)
    await ask("And trains?", "Trains: " + "ipsum " * 1500)
    stored = await store.load_window("acme", "trip-1")
    recent = sum(item.tokens for item in stored.items[-4:])
    counter = TokenCounter.for_model("gpt-4o")
    fixed = counter.item(chat_item(system)) + REPLY_PRIMING + output + margin
    wanted = window - fixed - recent - 2  # the current turn's tokens: 2 left for history
    words = wanted
    while counter.item(chat_item({"role": "user", "content": "Pick one." + " x" * words})) > wanted:
        words -= 1
    current = "Pick one." + " x" * words
    assert counter.item(chat_item({"role": "user", "content": current})) == wanted
    sent = await ask(current, "Done.")
    blocks = summaries(sent)
    assert blocks and blocks[0] == earlier[0]  # the earlier block, byte for byte
    total = 2 * (turn + 2)  # every item before this request but the system message
    verbatim = len(sent) - 2 - len(blocks)
    assert stands_for(blocks) == total - verbatim
    thread = await store.get_thread("acme", "trip-1")
    assert thread is not None
    stored_chain = [s["raw"]["content"] for s in thread.state["summary"]]
    assert [text for text in stored_chain if text.startswith(SUMMARY_MARKER)] == blocks


async def test_thread_summary_always_stands_for_every_item_cut(make_proxy: ProxyFactory) -> None:
    proxy: Proxy = await make_proxy(window=5200)
    client = proxy.client()
    system = {"role": "system", "content": "You are a travel agent."}
    previous: list[str] = []
    cuts = 0
    for turn in range(40):
        proxy.provider.script.append(Reply(text=f"Option {turn}: " + "lorem " * reply_words(turn)))
        user = {
            "role": "user",
            "content": f"Q{turn}: my budget is {1000 + turn} EUR, ref BK-{turn}.",
        }
        messages = [system, user] if turn == 0 else [user]
        await client.chat.completions.create(
            model="gpt-4o",
            messages=messages,
            extra_headers=THREAD,  # type: ignore[arg-type]
        )
        sent = proxy.provider.model_requests[-1].json["messages"]
        blocks = summaries(sent)
        verbatim = len(sent) - 1 - len(blocks) - 1  # the system message, the current turn
        assert sent[0] == system and sent[-1] == user
        # Every item not sent verbatim is stood for by a block: none is silently lost.
        assert stands_for(blocks) == 2 * turn - verbatim
        if blocks and blocks != previous:
            cuts += 1
            if previous and blocks[: len(previous)] != previous:
                assert len(blocks) == 1  # a consolidation rewrites the chain once
        previous = blocks
    assert cuts >= 3


async def test_thread_stored_with_one_digest_keeps_it_first_in_the_chain(
    make_proxy: ProxyFactory,
) -> None:
    """A thread whose state was written before the chain (pinned items, then one digest)
    goes on with that digest, byte for byte, ahead of the blocks later cuts append."""
    proxy: Proxy = await make_proxy(window=5200)
    client = proxy.client()
    for turn in range(3):
        await client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": f"Q{turn}: hello"}],
            extra_headers=THREAD,
        )
    store = proxy.app[STORE]  # type: ignore[index]
    thread = await store.get_thread("acme", "trip-1")
    assert thread is not None
    digest = f"{SUMMARY_MARKER} Stands for 4 earlier items no longer sent verbatim.\n- BK-7"
    old_state = {
        **thread.state,
        "window_start": 4,
        "summary": [{"api": "chat", "raw": {"role": "system", "content": digest}}],
        "compressed": [],
    }
    await store.append_items(
        "acme", "trip-1", [], expected_version=thread.version, state=old_state, now="2026-01-01"
    )
    appended = False
    for turn in range(3, 40):
        proxy.provider.script.append(Reply(text="lorem " * 300))
        await client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": f"Q{turn}: next"}],
            extra_headers=THREAD,
        )
        blocks = summaries(proxy.provider.model_requests[-1].json["messages"])
        if blocks[0] != digest:  # consolidated once: one block standing for all of it
            assert len(blocks) == 1 and stands_for(blocks) > 4
            break
        appended = appended or len(blocks) > 1
    assert appended  # a later cut appended a block after the stored digest


async def test_stateless_client_gets_the_same_summary_bytes_for_the_same_history(
    make_proxy: ProxyFactory,
) -> None:
    """A client without X-Thread-Id resends its whole history: the provider gets the
    same summary blocks for the same history prefix, extended as the history grows (the
    summary used to be rewritten at every request, a cache miss after the system text)."""
    proxy: Proxy = await make_proxy(window=5200)
    client = proxy.client()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel agent."}]
    previous: list[str] = []
    repeated = extended = 0
    for turn in range(100):  # the first cut comes at about turn 46, then every 17 turns
        proxy.provider.script.append(Reply(text=f"Noted {turn}. " + "lorem " * 60))
        messages.append({"role": "user", "content": f"Q{turn}: ref BK-{turn}, seat 12{turn}."})
        answer = await client.chat.completions.create(model="gpt-4o", messages=messages)  # type: ignore[arg-type]
        sent = proxy.provider.model_requests[-1].json["messages"]
        blocks = summaries(sent)
        verbatim = len(sent) - 2 - len(blocks)  # all but the system message, the question
        earlier = len(messages) - 2  # every message before the question but the system one
        assert stands_for(blocks) == earlier - verbatim
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        if blocks and blocks == previous:
            repeated += 1
        elif previous and blocks[: len(previous)] == previous:
            extended += 1
        elif previous:
            assert stands_for(blocks[:1]) > stands_for(previous[:1])  # a consolidation
        previous = blocks
    assert repeated >= 25 and extended >= 2
