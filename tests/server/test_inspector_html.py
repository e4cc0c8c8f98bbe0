"""The inspector's rendering, without a server: the token bar's segments and escaping."""

from __future__ import annotations

import re
from typing import Any

from proxy.server.inspector_html import FULL_TEXT_MAX, Chrome, _bounded, threads_page, token_bar


def record(blocks: list[dict[str, Any]], **projection: int) -> dict[str, Any]:
    base = {"window": 1000, "system": 50, "tools": 10, "current": 40, "output": 200, "epsilon": 50}
    base.update(projection)
    history = base.get("history_after", 300)
    base.update(
        history_after=history,
        prompt_tokens=base["system"] + base["tools"] + base["current"] + history,
        history_budget=0,
        history_before=0,
    )
    return {"projection": {**base, "blocks": blocks}}


def sent_and_kept(bar: str) -> dict[str, tuple[int, bool]]:
    found = re.findall(r'data-segment="([a-z-]+)" data-tokens="(\d+)" data-sent="(\w+)"', bar)
    return {name: (int(tokens), sent == "true") for name, tokens, sent in found}


def test_sent_segments_add_up_to_the_prompt_tokens_and_the_rest_fills_the_window() -> None:
    summary = {"kind": "summary", "first": 0, "last": 5, "tokens_before": 900}
    shown = record([{**summary, "tokens_after": 120, "action": "summarized"}])
    assert sent_and_kept(token_bar(shown)) == {
        "pinned": (50, True), "tools": (10, True), "summary": (120, True),
        "history": (180, True), "current": (40, True),
        "output-reserve": (200, False), "margin": (50, False), "free": (350, False),
    }  # fmt: skip
    dropped = record([{**summary, "tokens_after": 0, "action": "dropped"}])
    assert sent_and_kept(token_bar(dropped))["summary"] == (0, True)


def test_an_overflowing_window_is_drawn_against_the_sum() -> None:
    over = record([], history_after=900)  # more than the window: nothing is left free
    widths = [float(w) for w in re.findall(r"width:([0-9.]+)%", token_bar(over))]
    assert abs(sum(widths) - 100) < 0.01 and 'data-tokens="0"' in token_bar(over)


def test_every_value_is_escaped() -> None:
    hostile = '"><script>alert(1)</script>'
    thread = {
        "tenant": hostile, "namespace": hostile, "id": hostile, "kind": "chat", "items": 1,
        "window_start": None, "created_at": hostile,
    }  # fmt: skip
    page = threads_page(
        [thread], query=hostile, tenant=hostile, tenants=[hostile], namespace=hostile,
        chrome=Chrome(who=hostile, csrf=hostile, signed_in=True),
    )  # fmt: skip
    assert "<script>alert" not in page and page.count("<script>") == 1
    assert "&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_a_long_item_text_is_bounded_on_the_page() -> None:
    assert _bounded("x" * FULL_TEXT_MAX) == "x" * FULL_TEXT_MAX
    shown = _bounded("x" * (FULL_TEXT_MAX + 7))
    assert shown == "x" * FULL_TEXT_MAX + "\n[... 7 more characters: threadkeeper threads export]"
