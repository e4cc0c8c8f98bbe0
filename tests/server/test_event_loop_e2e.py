"""The event loop keeps serving while big requests are read into items and counted
(issue 8, item 14). Each test holds the work at a barrier in whatever thread runs it and
asks /healthz meanwhile: inline on the loop, the hold would freeze the loop itself."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

import proxy.core.items
from proxy.core.tokens import TokenCounter
from tests.server.conftest import TENANT_KEY

BIG = 1_000_000  # characters: far above what is handled inline


class Held:
    """Wraps a function so a call on a big argument waits until released; says whether
    one is waiting."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.holding = threading.Event()

    def wrap(self, original: Callable[..., Any], size: Callable[..., int]) -> Callable[..., Any]:
        def held(*args: Any) -> Any:
            if size(*args) > BIG and not self.release.is_set():
                self.holding.set()
                self.entered.set()
                self.release.wait(timeout=10)  # inline on the loop, this would freeze it
                self.holding.clear()
            return original(*args)

        return held


def hold_counting(monkeypatch: pytest.MonkeyPatch, held: Held) -> None:
    text = held.wrap(TokenCounter.text, lambda _counter, value: len(value))
    monkeypatch.setattr(TokenCounter, "text", text)


def hold_digests(monkeypatch: pytest.MonkeyPatch, held: Held) -> None:
    digest = held.wrap(proxy.core.items.content_digest, lambda raw: len(str(raw)))
    monkeypatch.setattr(proxy.core.items, "content_digest", digest)


BODIES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "lorem "}]}, {}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "lorem "}]},
        {"X-Thread-Id": "t-big"},
    ),
    ("/v1/responses", {"input": "lorem ", "store": False}, {}),
    ("/v1/responses", {"input": [{"role": "user", "content": "lorem "}]}, {}),
    ("/v1/responses/input_tokens", {"input": "lorem "}, {}),
]


@pytest.mark.parametrize("hold", [hold_counting, hold_digests], ids=["count", "digest"])
@pytest.mark.parametrize(("path", "body", "headers"), BODIES)
async def test_healthz_answers_while_a_big_message_is_processed(
    make_proxy,
    monkeypatch: pytest.MonkeyPatch,
    hold: Callable[[pytest.MonkeyPatch, Held], None],
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> None:
    proxy = await make_proxy(max_body_bytes=8 * 1024 * 1024, window=4_000_000)
    held = Held()
    hold(monkeypatch, held)
    body = {"model": "gpt-4o-mini", **_grown(body, 2 * BIG)}
    headers = {"Authorization": f"Bearer {TENANT_KEY}", **headers}
    async with proxy.http() as http:
        request = asyncio.create_task(http.post(path, json=body, headers=headers))
        assert await asyncio.to_thread(held.entered.wait, 10), "the big text was never reached"
        health = await asyncio.wait_for(http.get("/healthz"), timeout=5)
        answered_while_held = held.holding.is_set()
        held.release.set()
        response = await request
    assert health.status_code == 200
    assert answered_while_held  # the loop served /healthz while the work was in progress
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
