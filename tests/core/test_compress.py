import json

import pytest

from proxy.core.compress import compress_tool_output
from proxy.core.items import Item, chat_item, responses_item
from proxy.core.memory import SUMMARY_MARKER, is_summary, summarize_turns
from proxy.core.tokens import TokenCounter


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o")


def chat_call(call_id: str, name: str = "lookup_order", args: str = '{"order_id":"ORD-1"}') -> Item:
    function = {"name": name, "arguments": args}
    return chat_item(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
    )


def big_result() -> str:
    rows = [{"sku": f"SKU-{i}", "note": "lorem ipsum dolor " * 20} for i in range(420)]
    return json.dumps({"status": "shipped", "tracking_no": "YT123456", "rows": rows})


def test_json_result_keeps_facts_and_marks_elisions(counter: TokenCounter) -> None:
    output = chat_item({"role": "tool", "tool_call_id": "call_1", "content": big_result()})
    small = compress_tool_output(output, chat_call("call_1"), 300, counter)
    body = json.loads(small.raw["content"])
    assert body["threadkeeper_compressed"]["tool"] == "lookup_order"
    assert body["threadkeeper_compressed"]["call_id"] == "call_1"
    assert "time" not in body["threadkeeper_compressed"]  # the bytes do not change hourly
    facts = body["verified_facts"]
    assert facts["status"] == "shipped" and facts["tracking_no"] == "YT123456"
    assert facts["rows"][:2] == ["SKU-0", "SKU-1"]  # a list by its elements' ids
    assert "more items elided by threadkeeper" in small.raw["content"]
    assert counter.item(small) <= 300


def test_compressed_chat_output_keeps_its_keys_and_call(counter: TokenCounter) -> None:
    output = chat_item({"role": "tool", "tool_call_id": "call_1", "content": big_result()})
    small = compress_tool_output(output, chat_call("call_1"), 200, counter)
    assert set(small.raw) == {"role", "tool_call_id", "content"}
    assert small.output_for == "call_1" and small.kind == "tool_output"


def test_compressed_responses_output_keeps_its_keys(counter: TokenCounter) -> None:
    raw = {"type": "function_call_output", "call_id": "c9", "output": big_result(), "id": "fco_1"}
    call = responses_item(
        {"type": "function_call", "call_id": "c9", "name": "search", "arguments": "{}"}
    )
    small = compress_tool_output(responses_item(raw), call, 250, counter)
    assert set(small.raw) == set(raw)
    assert small.output_for == "c9"
    assert json.loads(small.raw["output"])["threadkeeper_compressed"]["tool"] == "search"
    assert counter.item(small) <= 250


def test_plain_text_keeps_head_and_tail(counter: TokenCounter) -> None:
    text = "HEAD " + "filler words here " * 2000 + " TAIL"
    output = chat_item({"role": "tool", "tool_call_id": "call_1", "content": text})
    small = compress_tool_output(output, chat_call("call_1"), 200, counter)
    excerpt = json.loads(small.raw["content"])["excerpt"]
    assert excerpt.startswith("HEAD") and excerpt.endswith("TAIL")
    assert "more characters elided by threadkeeper" in excerpt
    assert counter.item(small) <= 200


@pytest.mark.parametrize("limit", [40, 60, 100, 800])
def test_compressed_output_never_exceeds_the_limit(counter: TokenCounter, limit: int) -> None:
    output = chat_item({"role": "tool", "tool_call_id": "call_1", "content": big_result()})
    assert counter.item(compress_tool_output(output, None, limit, counter)) <= limit


def test_compression_is_deterministic(counter: TokenCounter) -> None:
    output = chat_item({"role": "tool", "tool_call_id": "call_1", "content": big_result()})
    first = compress_tool_output(output, chat_call("call_1"), 300, counter)
    second = compress_tool_output(output, chat_call("call_1"), 300, counter)
    assert first.raw == second.raw


def dropped_turns() -> list[Item]:
    return [
        chat_item({"role": "user", "content": "所有金额都用人民币，默认含税。查一下订单 ORD-1。"}),
        chat_call("call_1"),
        chat_item({"role": "tool", "tool_call_id": "call_1", "content": big_result()}),
        chat_item({"role": "assistant", "content": "ORD-1 has shipped."}),
        chat_item({"role": "user", "content": "Refund it. Never refund twice."}),
        chat_call("call_2", "refund_order"),
    ]


def test_summary_keeps_constraints_facts_and_pending_calls(counter: TokenCounter) -> None:
    summary = summarize_turns(dropped_turns(), counter, 400, None)
    text = summary.text()
    assert summary.raw["role"] == "system" and text.startswith(SUMMARY_MARKER)
    assert "所有金额都用人民币，默认含税。" in text
    assert "Never refund twice." in text
    assert "lookup_order(order_id=ORD-1) -> status=shipped, tracking_no=YT123456" in text
    assert "refund_order(order_id=ORD-1)" in text
    assert "call_1" not in text and "call_2" not in text  # no call ids in a digest
    assert text.index("Verified facts") < text.index("not verified")
    assert counter.item(summary) <= 400
    assert is_summary(summary)


def test_responses_summary_is_a_developer_message(counter: TokenCounter) -> None:
    items = [responses_item({"role": "user", "content": "always answer in French"})]
    summary = summarize_turns(items, counter, 200, None)
    assert summary.raw["type"] == "message" and summary.raw["role"] == "developer"
    assert "always answer in French" in summary.text()


def test_summary_shrinks_to_fit_keeping_constraints_first(counter: TokenCounter) -> None:
    items = dropped_turns() * 30
    summary = summarize_turns(items, counter, 120, None)
    assert counter.item(summary) <= 120
    assert "Never refund twice." in summary.text()


def test_summary_carries_the_previous_summary_forward(counter: TokenCounter) -> None:
    first = summarize_turns(dropped_turns()[:4], counter, 400, None)
    later = [chat_item({"role": "user", "content": "What about ORD-2?"})]
    second = summarize_turns(later, counter, 400, first)
    text = second.text()
    assert "Stands for 5 earlier items" in text
    assert "所有金额都用人民币，默认含税。" in text and "What about ORD-2?" in text


def test_summary_is_deterministic(counter: TokenCounter) -> None:
    a = summarize_turns(dropped_turns(), counter, 300, None)
    b = summarize_turns(dropped_turns(), counter, 300, None)
    assert a.raw == b.raw


def test_english_task_constraints_survive_the_summary(counter: TokenCounter) -> None:
    # Seed 7.1's counterexample: an early "all amounts in CNY, tax included" must not vanish.
    turns = [
        chat_item({"role": "user", "content": "All amounts in CNY, tax included. Thanks!"}),
        chat_item({"role": "assistant", "content": "Noted."}),
    ]
    text = summarize_turns(turns, counter, 300, None).text()
    assert "All amounts in CNY, tax included." in text


# --- content-aware compression (issue 10, item 4) --------------------------------------------


def pytest_log(passed: int = 410) -> str:
    """A long pytest run: one failure with its traceback, a pool warning mid-log."""
    lines = [
        "============================= test session starts ==============================",
        "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0",
        "collected 412 items",
    ]
    for i in range(passed):
        lines.append(f"tests/billing/test_invoices.py::test_invoice_case_{i:03d} PASSED")
        if i == passed // 3:
            lines.append(
                "WARNING  billing.db:pool.py:41 connection pool exhausted "
                "(max_connections=200 reached), waiting 5.0s"
            )
        if i == passed // 2:
            lines += [
                "=================================== FAILURES ===================================",
                "    def prorate(plan, days_used):",
                ">       return plan.price_cents * days_used // (plan.cycle_days - days_used - 30)",
                "E       ZeroDivisionError: integer division or modulo by zero",
                "",
                "src/billing/proration.py:88: ZeroDivisionError",
            ]
    lines.append("================== 1 failed, 411 passed in 38.21s ==================")
    return "\n".join(lines)


def test_a_long_log_keeps_its_traceback_and_mid_log_failure(counter: TokenCounter) -> None:
    output = chat_item({"role": "tool", "tool_call_id": "call_7", "content": pytest_log()})
    assert 6000 <= counter.item(output) <= 7500  # the 6.7k-token log
    small = compress_tool_output(output, chat_call("call_7", "run_tests"), 800, counter)
    assert counter.item(small) <= 800
    excerpt = json.loads(small.raw["content"])["excerpt"]
    assert "src/billing/proration.py:88: ZeroDivisionError" in excerpt
    assert "connection pool exhausted (max_connections=200 reached)" in excerpt
    assert "E       ZeroDivisionError: integer division or modulo by zero" in excerpt
    assert excerpt.startswith("=====") and excerpt.endswith("in 38.21s ==================")
    assert "lines elided by threadkeeper" in excerpt


def test_a_log_keeps_its_errors_even_at_a_quarter_of_the_room(counter: TokenCounter) -> None:
    output = chat_item({"role": "tool", "tool_call_id": "call_7", "content": pytest_log()})
    small = compress_tool_output(output, None, 200, counter)
    excerpt = json.loads(small.raw["content"])["excerpt"]
    assert counter.item(small) <= 200
    assert "proration.py:88" in excerpt


def test_text_lines_holding_referenced_values_are_kept(counter: TokenCounter) -> None:
    rows = [f"row {i}: booking BK-{1000 + i} confirmed" for i in range(600)]
    output = chat_item({"role": "tool", "tool_call_id": "c", "content": "\n".join(rows)})
    plain = compress_tool_output(output, None, 300, counter)
    kept = compress_tool_output(output, None, 300, counter, frozenset({"BK-1377"}))
    assert "BK-1377" not in plain.raw["content"]
    assert "row 377: booking BK-1377 confirmed" in json.loads(kept.raw["content"])["excerpt"]


def test_json_facts_are_found_nested_without_transport_metadata(counter: TokenCounter) -> None:
    body = {
        "request_id": "req_8f2a91",
        "served_by": "api-eu-3",
        "generated_at": "2026-11-30T10:00:00Z",
        "meta": {"trace_id": "tr-99", "page": 1},
        "data": {
            "order": {"id": "ORD-7731", "status": "lost_in_transit", "notes": "x " * 800},
            "refunds": [
                {"refund_id": f"RF-{i}", "amount": 10 + i, "currency": "EUR", "blob": "y" * 300}
                for i in range(40)
            ],
        },
    }
    output = chat_item({"role": "tool", "tool_call_id": "c1", "content": json.dumps(body)})
    small = compress_tool_output(output, None, 400, counter, frozenset({"RF-33"}))
    facts = json.loads(small.raw["content"])["verified_facts"]
    text = json.dumps(facts)
    assert "ORD-7731" in text and "lost_in_transit" in text and "RF-0" in text
    assert "RF-33" in text  # referenced later: kept although past the first elements
    for noise in ("req_8f2a91", "api-eu-3", "2026-11-30T10:00:00Z", "tr-99"):
        assert noise not in small.raw["content"]
    assert counter.item(small) <= 400


def test_json_lists_are_summarized_by_their_identifying_values(counter: TokenCounter) -> None:
    body = [{"sku": f"SKU-{i}", "qty": i, "note": "n" * 50} for i in range(30)]
    output = chat_item({"role": "tool", "tool_call_id": "c", "content": json.dumps(body)})
    small = compress_tool_output(output, None, 200, counter)
    facts = json.loads(small.raw["content"])["verified_facts"]
    assert facts["item_count"] == 30
    assert facts["items"][0].startswith("SKU-0") and facts["items"][-1].endswith("more)")


def test_upper_case_error_lines_survive_compression() -> None:
    from proxy.core.items import chat_item
    from proxy.core.tokens import TokenCounter

    lines = [f"10:{i % 60:02d} INFO checkout handled request {i} in {20 + i}ms" for i in range(600)]
    lines.insert(301, "ERROR pg: remaining connection slots are reserved")
    output = chat_item({"role": "tool", "tool_call_id": "c1", "content": "\n".join(lines)})
    counter = TokenCounter.for_model("gpt-4o")
    smaller = compress_tool_output(output, None, 300, counter)
    assert counter.item(smaller) <= 300
    assert "ERROR pg: remaining connection slots are reserved" in smaller.text()


def test_a_dense_text_is_cut_by_its_plan_not_replaced_by_a_bare_marker() -> None:
    """A text of fewer than 4 characters a token (hex ids, numbers) shorter than
    4 * max_tokens characters was never planned: every excerpt was the whole text, too
    big, and the result became the bare source marker, its one rare line gone."""
    counter = TokenCounter.for_model("gpt-4o")
    lines = [f"{i:04x} 9f{i:03d}e 7a{i * 7 % 1000:03d} 3c{i % 97:02d} ok" for i in range(90)]
    lines.insert(77, "legal hold: do not contact until 2027-02-27 (dispute 866)")
    text = "\n".join(lines)
    output = chat_item({"role": "tool", "tool_call_id": "c", "content": text})
    assert len(text) < 4 * 800 and counter.item(output) > 800
    shown = json.loads(compress_tool_output(output, None, 800, counter).raw["content"])
    assert "legal hold: do not contact until 2027-02-27 (dispute 866)" in shown["excerpt"]


def _tool(content: str, call_id: str = "c") -> Item:
    return chat_item({"role": "tool", "tool_call_id": call_id, "content": content})


def test_a_text_tables_outlier_row_is_kept_verbatim() -> None:
    """One template for every row of a table: the collapsed form names the extreme value
    in its range, the row holding it is kept too (templates.outlier_lines)."""
    counter = TokenCounter.for_model("gpt-4o")
    rows = [
        f"2026-10-{d:02d} | DACH | {900 + d * 7} | {54000 + d * 311}.25 | {20 + d % 9}"
        for d in range(1, 31)
    ]
    rows[17] = "2026-10-18 | DACH | 61 | 1569.94 | 3"
    text = "day | region | orders | revenue_eur | returns\n" + "\n".join(rows * 3)
    shown = json.loads(compress_tool_output(_tool(text), None, 300, counter).raw["content"])
    assert "2026-10-18 | DACH | 61 | 1569.94 | 3" in shown["excerpt"]


def test_a_lists_outlier_record_is_kept_whole() -> None:
    counter = TokenCounter.for_model("gpt-4o")
    points = [{"t": f"14:{m:02d}", "p99_ms": 180 + (m * 37) % 240} for m in range(60)]
    points[36]["p99_ms"] = 5363
    body = {"metric": "payments-api p99", "points": points}
    shown = compress_tool_output(_tool(json.dumps(body)), None, 250, counter).raw["content"]
    assert '{"t": "14:36", "p99_ms": 5363}' in shown


def test_the_one_record_of_a_rare_status_is_kept_whole() -> None:
    counter = TokenCounter.for_model("gpt-4o")
    pods = [
        {"name": f"api-{i:03d}-x{i * 7 % 97:02d}", "ready": "1/1", "status": "Running"}
        for i in range(48)
    ]
    pods[29] = {"name": "ledger-1db37535f-55a3d", "ready": "0/1", "status": "CrashLoopBackOff"}
    shown = compress_tool_output(_tool(json.dumps({"items": pods})), None, 300, counter)
    assert "ledger-1db37535f-55a3d" in shown.raw["content"]


def test_a_rare_string_of_a_json_list_is_kept() -> None:
    """A list of log lines or notes inside JSON: the one of a rare template survives."""
    counter = TokenCounter.for_model("gpt-4o")
    lines = [
        f"2026-11-14T14:{m:02d}:{m * 7 % 60:02d}Z ERROR payments-api upstream=10.4.3.{m % 20}:8080 "
        f'status=502 msg="Bad Gateway" trace={m * 7919:016x}'
        for m in range(50)
    ]
    rare = "2026-11-14T14:33:05Z ERROR db.pool connection pool exhausted (max_connections=100 reached) pid=2298"
    lines.insert(33, rare)
    body = {"query": "service:payments-api level>=WARN", "hits": 51, "lines": lines}
    shown = compress_tool_output(_tool(json.dumps(body)), None, 500, counter).raw["content"]
    assert rare in shown


def test_a_file_content_inside_json_is_compressed_as_text() -> None:
    """{"path", "content"}: the content is a listing; a line named by number is kept."""
    counter = TokenCounter.for_model("gpt-4o")
    code = []
    for n in range(30):
        code += [f"def helper_{n}(value, factor={n + 2}):", f"    return value * factor + {n}", ""]
    code[55] = "    if attempt > max_retries:"
    body = {"path": "billing/export.py", "lines": len(code), "content": "\n".join(code)}
    output = _tool(json.dumps(body))
    shown = compress_tool_output(output, None, 300, counter, frozenset({"line 56"}))
    parsed = json.loads(shown.raw["content"])
    assert "    if attempt > max_retries:" in parsed["excerpt"]
    assert parsed["verified_facts"]["path"] == "billing/export.py"


def test_a_repetitive_pages_one_new_sentence_is_kept_and_repeats_are_not() -> None:
    """A page of boilerplate said again and again: its one sentence of a rare template
    (the finding) survives, though every other sentence carries more of the query's
    terms ("support", "report")."""
    counter = TokenCounter.for_model("gpt-4o")
    pool = [
        "Support teams increasingly route simple questions to self-service articles.",
        "The report groups companies by headcount and by primary support channel.",
        "Analysts caution that self-reported figures tend to overstate improvements.",
        "Several vendors report that chat deflection rates vary widely by industry.",
    ]
    body = [pool[(i * 7) % 4] for i in range(90)]
    finding = "Across the 412 companies studied, the median first-response time fell from 13.3 hours to 2.1 hours."
    body.insert(61, finding)
    page = json.dumps({"url": "https://x.io/reports/1-ai-support-study", "text": " ".join(body)})
    call = chat_item(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {
                        "name": "fetch_page",
                        "arguments": '{"url": "https://x.io/reports/1-ai-support-study"}',
                    },
                }
            ],
        }
    )
    small = compress_tool_output(_tool(page), call, 400, counter)
    assert finding in json.loads(small.raw["content"])["excerpt"]
    assert counter.item(small) <= 400
