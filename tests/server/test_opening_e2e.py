"""The opening head through the socket (memory.keep_opening_share): once a thread is cut,
the provider receives its opening turns verbatim, byte for byte the same at every later
request, ahead of the summaries; for a stateless client, a stored thread and a thread
resumed by another proxy on the same store alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proxy.core.memory import SUMMARY_MARKER
from proxy.fake_provider import Reply

SYSTEM = {"role": "system", "content": "You book hotels."}
RULES = "My rules: every hotel must be within 500 m of a station, and no hotel above 180 EUR."


def question(turn: int) -> str:
    return (
        RULES if turn == 0 else f"Turn {turn}: book hotel H-{turn} for the night of the {turn}th."
    )


def head_length(messages: list[dict[str, Any]]) -> int | None:
    """Index of the first summary message, i.e. how many messages come before it."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and content.startswith(SUMMARY_MARKER):
            return index
    return None


async def test_the_opening_turns_reach_the_provider_verbatim_after_every_cut(
    make_proxy,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    store = f"sqlite:///{tmp_path / 'head.db'}"
    proxy = await make_proxy(window=4200, store_url=store)
    client = proxy.client()
    headers = {"X-Thread-Id": "t-head"}
    full: list[dict[str, Any]] = [SYSTEM]
    seen: list[list[dict[str, Any]]] = []
    turns = 110
    for turn in range(turns):
        full.append({"role": "user", "content": question(turn)})
        stateless = await client.chat.completions.create(model="gpt-4o", messages=full)
        sent_stateless = proxy.provider.model_requests[-1].json["messages"]
        new = [SYSTEM, full[-1]] if turn == 0 else [full[-1]]
        if turn == turns - 1:  # the last turn goes to another proxy on the same store
            proxy = await make_proxy(window=4200, store_url=store)
            client = proxy.client()
        await client.chat.completions.create(model="gpt-4o", messages=new, extra_headers=headers)
        sent_stored = proxy.provider.model_requests[-1].json["messages"]
        assert sent_stored == sent_stateless
        seen.append(sent_stored)
        full.append({"role": "assistant", "content": stateless.choices[0].message.content})
    cut = [index for index, messages in enumerate(seen) if head_length(messages) is not None]
    assert cut, "the thread never outgrew its window"
    length = head_length(seen[cut[0]])
    assert length is not None and length > 3
    head = full[:length]
    assert head[1]["content"] == RULES
    summaries = set()
    for messages in seen[cut[0] :]:
        assert messages[:length] == head  # the opening turns, verbatim, every time
        assert head_length(messages) == length
        summaries.add(sum(1 for m in messages if str(m.get("content")).startswith(SUMMARY_MARKER)))
    assert max(summaries) >= 2  # later cuts appended blocks after the head


async def test_an_assistant_that_repeats_itself_does_not_break_the_head(
    make_proxy,  # type: ignore[no-untyped-def]
) -> None:
    """Every answer "Noted.": the head's copies matched the window's by content, and the
    order check refused the stateless request with a 500."""
    proxy = await make_proxy(window=4200)
    client = proxy.client()
    history: list[dict[str, Any]] = [SYSTEM]
    for turn in range(110):
        history.append({"role": "user", "content": question(turn)})
        proxy.provider.script.append(Reply(text="Noted."))
        await client.chat.completions.create(model="gpt-4o", messages=history)
        history.append({"role": "assistant", "content": "Noted."})
    sent = proxy.provider.model_requests[-1].json["messages"]
    length = head_length(sent)
    assert length is not None and length > 3 and sent[:length] == history[:length]
