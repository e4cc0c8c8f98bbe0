"""The event loop keeps serving while big requests are counted (issue 8, item 14)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest

from proxy.core.tokens import TokenCounter
from tests.server.conftest import TENANT_KEY

BIG = 1_000_000  # characters: far above what is counted inline


class HeldCounting:
    """Holds the count of any text above BIG until released, and says whether it is held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.holding = threading.Event()
        original = TokenCounter.text

        def text(counter: TokenCounter, value: str) -> int:
            if len(value) > BIG and not self.release.is_set():
                self.holding.set()
                self.entered.set()
                self.release.wait(timeout=10)  # inline on the loop, this would freeze it
                self.holding.clear()
            return original(counter, value)

        monkeypatch.setattr(TokenCounter, "text", text)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "lorem "}]}),
        ("/v1/responses", {"input": "lorem ", "store": False}),
        ("/v1/responses", {"input": [{"role": "user", "content": "lorem "}]}),
        ("/v1/responses/input_tokens", {"input": "lorem "}),
    ],
)
async def test_healthz_answers_while_a_big_message_is_counted(
    make_proxy, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    proxy = await make_proxy(max_body_bytes=8 * 1024 * 1024, window=4_000_000)
    held = HeldCounting(monkeypatch)
    body = {"model": "gpt-4o-mini", **_grown(body, 2 * BIG)}
    headers = {"Authorization": f"Bearer {TENANT_KEY}"}
    async with proxy.http() as http:
        request = asyncio.create_task(http.post(path, json=body, headers=headers))
        assert await asyncio.to_thread(held.entered.wait, 10), "the big text was never counted"
        health = await asyncio.wait_for(http.get("/healthz"), timeout=5)
        answered_while_held = held.holding.is_set()
        held.release.set()
        response = await request
    assert health.status_code == 200
    assert answered_while_held  # the loop served /healthz while the count was in progress
    assert response.status_code == 200, response.text


def _grown(body: dict[str, Any], size: int) -> dict[str, Any]:
    """The body with its one "lorem " text repeated to `size` characters (a fresh text
    each time: token counts are cached by content)."""
    text = uuid.uuid4().hex + " lorem" * (size // 6)
    if "messages" in body:
        return {"messages": [{"role": "user", "content": text}]}
    if isinstance(body["input"], str):
        return {**body, "input": text}
    return {**body, "input": [{"role": "user", "content": text}]}
