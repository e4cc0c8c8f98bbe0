"""Stored token counts and digests are read, never recomputed (SPEC section 4).

A fresh app over an existing store (a restart, or another replica) must tokenize only
what a turn adds: the items already in the thread carry their count from the store.
"""

from __future__ import annotations

from typing import Any

import pytest

import proxy.fake_provider
from proxy.core.tokens import TokenCounter
from tests.server.conftest import ProxyFactory

TURNS = 12
OLD = "earlier-turn"


class Tokenized:
    """Every text the proxy hands the tokenizer."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.texts: list[str] = []
        original = TokenCounter.text

        def text(counter: TokenCounter, value: str) -> int:
            self.texts.append(value)
            return original(counter, value)

        monkeypatch.setattr(TokenCounter, "text", text)
        # The fake provider counts usage with the same TokenCounter in this process.
        monkeypatch.setattr(proxy.fake_provider, "chat_prompt_tokens", lambda body: 10)
        monkeypatch.setattr(proxy.fake_provider, "responses_prompt_tokens", lambda body: 10)
        monkeypatch.setattr(proxy.fake_provider, "reply_tokens", lambda *args: 2)

    def of_old_items(self) -> list[str]:
        return [t for t in self.texts if OLD in t]


def restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new process does not have: the per-process count cache."""
    monkeypatch.setattr(TokenCounter, "_cache", {})


async def test_conversation_turn_after_restart_counts_only_new_items(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    store_url = f"sqlite:///{tmp_path / 'shared.db'}"
    first = await make_proxy(store_url=store_url)
    conversation = await first.client().conversations.create()
    for n in range(TURNS):
        await first.client().responses.create(
            model="gpt-4o", conversation=conversation.id, input=f"{OLD} {n}"
        )

    restart(monkeypatch)
    tokenized = Tokenized(monkeypatch)
    second = await make_proxy(store_url=store_url)
    await second.client().responses.create(
        model="gpt-4o", conversation=conversation.id, input="the new question"
    )
    assert tokenized.of_old_items() == []
    assert "the new question" in tokenized.texts
    assert len(tokenized.texts) == 4  # the new input and the reply: role and text each


async def test_chat_thread_turn_after_restart_counts_only_new_messages(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    store_url = f"sqlite:///{tmp_path / 'shared.db'}"
    first = await make_proxy(store_url=store_url)
    headers = {"X-Thread-Id": "t-restart"}
    history: list[dict[str, Any]] = []
    for n in range(TURNS):
        history.append({"role": "user", "content": f"{OLD} {n}"})
        done = await first.client().chat.completions.create(
            model="gpt-4o", messages=history, extra_headers=headers
        )
        history.append({"role": "assistant", "content": done.choices[0].message.content})

    restart(monkeypatch)
    tokenized = Tokenized(monkeypatch)
    second = await make_proxy(store_url=store_url)
    await second.client().chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "the new question"}],
        extra_headers=headers,
    )
    assert tokenized.of_old_items() == []
    assert "the new question" in tokenized.texts
