"""Salience through the proxy (issue 22, items 2, 3 and 5): a dense table's outlier row,
a JSON list's one rare note and a listing's line that a later turn names reach the
provider in every request once the thread outgrows its window, compressed or summarized."""

from __future__ import annotations

import json
from typing import Any

from tests.core.test_salience import BUG, listing
from tests.server.test_code_docs_compression_e2e import history as code_docs_history
from tests.server.test_code_docs_compression_e2e import turn

OUTLIER_ROW = "2026-10-18 | DACH | 61 | 1569.94 | 3"
HOLD = "2026-11-26T15:40:53Z legal hold: do not contact until 2027-07-15 (dispute 437)"


def table() -> str:
    """A dense table (under 4 characters a token, under 3,200 characters): on main it
    became the bare source marker."""
    rows = [
        f"2026-10-{d:02d} | DACH | {900 + d * 7} | {54000 + d * 311}.25 | {20 + d % 9}"
        for d in range(1, 31)
    ]
    rows[17] = OUTLIER_ROW
    return "day | region | orders | revenue_eur | returns\n" + "\n".join(rows)


def account() -> str:
    notes = [
        f"2026-11-{d:02d}T10:00:00Z call logged by ana: follow-up scheduled" for d in range(1, 21)
    ]
    notes.insert(12, HOLD)
    deals = [
        {"deal": f"D-{10000 + i * 7919 % 89999}", "value_eur": 1000 + i * 13} for i in range(10)
    ]
    return json.dumps({"account": "ACC-7093", "deals": deals, "activity": notes})


def history(steps: int) -> list[dict[str, Any]]:
    """The three results, a later turn naming the listing's line, then routine turns
    (the rest of issue 22's e2e histories: the same tool turns, the same filler)."""
    messages = turn("call_sql", "run_sql", {"q": "daily"}, table(), "Thirty days of DACH.")
    messages += turn("call_acc", "get_account", {"id": "ACC-7093"}, account(), "Its notes.")
    messages += turn("call_src", "read_file", {"path": "calendar_0.py"}, listing(), "Read.")
    named = "I think line 152 of calendar_0.py is the leap-year bug."
    messages += [{"role": "user", "content": named}, {"role": "assistant", "content": "Noted."}]
    filler = code_docs_history(steps)[len(code_docs_history(0)) - 1 : -1]
    return [*messages, *filler, {"role": "user", "content": "Fix it."}]


async def test_outliers_rare_notes_and_later_named_lines_reach_the_provider(make_proxy) -> None:  # type: ignore[no-untyped-def]
    proxy = await make_proxy(window=6000)
    client = proxy.client()
    compressed: set[str] = set()
    for steps in (1, 2, 4, 8, 12):
        await client.chat.completions.create(model="gpt-4o", messages=history(steps))
        sent = proxy.provider.model_requests[-1].json["messages"]
        text = "\n".join(m["content"] for m in sent if isinstance(m.get("content"), str))
        for fact in (OUTLIER_ROW, HOLD, BUG.strip()):
            assert fact in text, (steps, fact)
        for message in sent:
            if message["role"] == "tool" and "threadkeeper_compressed" in message["content"]:
                compressed.add(message["tool_call_id"])
    assert compressed == {"call_sql", "call_acc", "call_src"}
