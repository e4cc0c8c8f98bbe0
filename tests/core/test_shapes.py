"""JSON by schema (issue 22, item 2): a compressed list of records keeps its identifiers
when there are few, the distinct values of a low-cardinality column, numeric columns as
first / last / min / max with their outliers, and whole the records the conversation
names; a series keeps first, last, min, max, trend and anomalies."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from proxy.core.compress import compress_tool_output
from proxy.core.items import Item, chat_item
from proxy.core.shapes import series
from proxy.core.tokens import TokenCounter


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o")


def compressed(body: Any, counter: TokenCounter, referenced: frozenset[str] = frozenset()) -> str:
    output = chat_item({"role": "tool", "tool_call_id": "c", "content": json.dumps(body)})
    small = compress_tool_output(output, None, 600, counter, referenced)
    assert counter.item(small) <= 600
    return str(small.raw["content"])


def invoices(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "invoice_id": f"INV-{i:05d}",
            "status": "paid",
            "amount": round(rng.uniform(80, 120), 2),
            "memo": "monthly subscription " * 6,
        }
        for i in range(count)
    ]


@pytest.mark.parametrize("seed", range(4))
def test_the_outlier_of_a_numeric_column_is_kept_with_its_record_id(
    counter: TokenCounter, seed: int
) -> None:
    rows = invoices(400, seed)
    odd = random.Random(seed + 50).randrange(len(rows))
    rows[odd]["amount"] = 14250.0
    shown = compressed(rows, counter)
    assert f"INV-{odd:05d}=14250" in shown
    assert '"count": 400' in shown


def test_a_rare_status_among_many_is_listed_with_its_count(counter: TokenCounter) -> None:
    rows = invoices(300, 1)
    rows[217]["status"] = "disputed"
    facts = json.loads(compressed({"invoices": rows}, counter))["verified_facts"]
    assert facts["invoices_shape"]["status"] == {"paid": 299, "disputed": 1}


def test_every_identifier_of_a_short_list_is_kept(counter: TokenCounter) -> None:
    rows = invoices(20, 2)
    shown = compressed(rows, counter)
    assert all(f"INV-{i:05d}" in shown for i in range(20))


def test_a_record_the_conversation_names_is_kept_whole(counter: TokenCounter) -> None:
    rows = [
        {
            "claim_id": f"CLM-{4000 + i}",
            "status": "open",
            "adjuster": f"adj-{i % 7}",
            "note": f"n{i}",
        }
        for i in range(200)
    ]
    facts = json.loads(compressed(rows, counter, frozenset({"CLM-4171"})))["verified_facts"]
    assert facts["items[171]"] == {
        "claim_id": "CLM-4171",
        "status": "open",
        "adjuster": "adj-3",
        "note": "n171",
    }


def test_a_metric_series_keeps_its_shape_and_its_anomaly(counter: TokenCounter) -> None:
    points = [
        {"ts": f"2026-11-30T10:{m:02d}:00Z", "p99_ms": 120 + m * 3 + (m % 5)} for m in range(60)
    ]
    points[41]["p99_ms"] = 4800
    facts = json.loads(compressed({"series": points}, counter))["verified_facts"]
    described = facts["series_shape"]["p99_ms"]
    assert described["first"] == 120 and described["max"] == 4800
    assert described["trend"] == "rising"
    assert described["anomalies"] == ["2026-11-30T10:41:00Z=4800"]


def test_one_spike_among_ten_points_is_an_anomaly() -> None:
    """3 sigma over ten points can never flag one value (its z-score is at most 2.85);
    the median absolute deviation does."""
    values = [10.0, 11.0, 10.5, 9.8, 10.2, 95.0, 10.1, 9.9, 10.4, 10.0]
    described = series(values, [str(i) for i in range(10)])
    assert described["anomalies"] == ["5=95"] and described["trend"] == "flat"


def tool_turn(name: str, body: Any) -> list[Item]:
    """A call of `name` and its JSON result `body`."""
    function = {"name": name, "arguments": "{}"}
    return [
        chat_item(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": function}],
            }
        ),
        chat_item({"role": "tool", "tool_call_id": "c", "content": json.dumps(body)}),
    ]


def test_the_digest_names_the_outlier_of_a_list() -> None:
    """Summarized, the one odd amount among 400 routine ones is in the tool fact."""
    from proxy.core.memory import extract

    rows = invoices(400, 9)
    rows[333]["amount"] = 14250.0
    [fact] = extract(tool_turn("list_invoices", {"invoices": rows})).facts
    assert "invoices.amount outliers=[INV-00333=14250]" in fact


def accounts() -> list[dict[str, Any]]:
    rng = random.Random(4)
    rows: list[dict[str, Any]] = [
        {"account_id": f"CUS-{rng.randrange(10**5, 10**6)}", "plan": "team", "mrr": 0.0}
        for _ in range(3)
    ]
    rows += [
        {"account_id": f"CUS-{rng.randrange(10**5, 10**6)}", "plan": "pro", "mrr": m}
        for m in (412.5, 388.0, 905.25, 120.0, 615.75, 240.0, 530.0, 77.0, 450.0)
    ]
    return rows


def test_the_extremes_of_an_identified_list_name_their_records(counter: TokenCounter) -> None:
    """A record named by its column's extreme ("the account with the highest MRR"): the
    shape says which record holds the max (one record alone holds it); the min, held by
    three, names none; first and last, the values of whichever rows come first, give way."""
    rows = accounts()
    top = next(r["account_id"] for r in rows if r["mrr"] == 905.25)
    facts = json.loads(compressed({"accounts": rows}, counter))["verified_facts"]
    described = facts["accounts_shape"]["mrr"]
    assert described == {"min": 0, "max": 905.25, "max_at": top}


def test_the_digest_names_the_record_holding_a_columns_extreme() -> None:
    from proxy.core.memory import extract

    rows = accounts()
    top = next(r["account_id"] for r in rows if r["mrr"] == 905.25)
    [fact] = extract(tool_turn("churned_accounts", {"accounts": rows})).facts
    assert f"accounts.mrr max={top}=905.25" in fact
