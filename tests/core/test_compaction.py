"""The pure half of compaction: sealing, opening, the stable id, and where a compaction
stands in a history (proxy/core/compaction.py)."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core import memory
from proxy.core.compaction import (
    BLOB_PREFIX,
    CompactionError,
    CompactionKey,
    compacted_output,
    compaction_summary,
    covered,
    current_turn_start,
    plan_compaction,
    render_summary,
    replaced,
    summary_message,
    summary_of,
)
from proxy.core.items import Item, responses_item
from proxy.core.memory import SUMMARY_MARKER
from proxy.core.tokens import TokenCounter

KEY = CompactionKey(bytes(range(32)))
SUMMARY = {"format": "memory", "state": {"count": 2, "rules": ["never book red-eye flights"]}}


def user(text: str) -> Item:
    return responses_item({"role": "user", "content": text})


def assistant(text: str) -> Item:
    return responses_item({"type": "message", "role": "assistant", "content": text})


def call(call_id: str) -> Item:
    return responses_item(
        {"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": "{}"}
    )


def output(call_id: str) -> Item:
    return responses_item({"type": "function_call_output", "call_id": call_id, "output": "ok"})


def test_a_sealed_summary_opens_for_its_tenant_only() -> None:
    blob = KEY.seal("acme", SUMMARY)
    assert blob.startswith(BLOB_PREFIX)
    assert KEY.open("acme", blob) == SUMMARY
    with pytest.raises(CompactionError, match="could not be verified"):
        KEY.open("globex", blob)
    with pytest.raises(CompactionError, match="could not be verified"):
        CompactionKey(bytes(32)).open("acme", blob)


def test_the_same_summary_seals_to_the_same_bytes_and_id() -> None:
    assert KEY.seal("acme", SUMMARY) == KEY.seal("acme", dict(reversed(SUMMARY.items())))
    assert KEY.item("acme", SUMMARY) == KEY.item("acme", SUMMARY)
    other = {**SUMMARY, "state": {"count": 3}}
    assert KEY.item_id("acme", other) != KEY.item_id("acme", SUMMARY)
    assert KEY.item_id("globex", SUMMARY) != KEY.item_id("acme", SUMMARY)
    assert KEY.item_id("acme", SUMMARY).startswith("cmp_")


def test_the_plaintext_is_not_in_the_blob() -> None:
    blob = KEY.seal("acme", SUMMARY)
    raw = base64.urlsafe_b64decode(blob[len(BLOB_PREFIX) :])
    assert b"red-eye" not in raw


@pytest.mark.parametrize("index", range(0, 60, 7))
def test_any_changed_byte_is_refused(index: int) -> None:
    blob = KEY.seal("acme", SUMMARY)
    raw = bytearray(base64.urlsafe_b64decode(blob[len(BLOB_PREFIX) :]))
    raw[index % len(raw)] ^= 1
    with pytest.raises(CompactionError):
        KEY.open("acme", BLOB_PREFIX + base64.urlsafe_b64encode(bytes(raw)).decode())


@pytest.mark.parametrize(
    "blob", [None, 7, "", "gAAAAABfernet==", BLOB_PREFIX, BLOB_PREFIX + "%%%", BLOB_PREFIX + "AAAA"]
)
def test_what_is_not_a_blob_is_a_compaction_error(blob: object) -> None:
    with pytest.raises(CompactionError):
        KEY.open("acme", blob)


_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def lenient_spellings(blob: str) -> dict[str, str]:
    """Other spellings of `blob`'s bytes that a lenient base64 decoder reads the same."""
    body = blob[len(BLOB_PREFIX) :]
    data = body.rstrip("=")
    spellings = {
        "four '=' after": blob + "====",
        "one '=' after": blob + "=",
        "a newline after": blob + "\n",
        "a space inside": BLOB_PREFIX + body[:8] + " " + body[8:],
        "standard alphabet": BLOB_PREFIX + body.replace("-", "+").replace("_", "/"),
        "a NUL after": blob + "\x00",
    }
    if data != body:
        spellings["padding left off"] = BLOB_PREFIX + data
        bumped = _ALPHABET[_ALPHABET.index(data[-1]) + 1]  # pad bits only: they are zero
        spellings["pad bits set"] = BLOB_PREFIX + data[:-1] + bumped + body[len(data) :]
    return spellings


@pytest.mark.parametrize("pad", range(3))
def test_only_the_canonical_spelling_of_a_blob_opens(pad: int) -> None:
    """Issue 20, item 9: `encrypted_content + "===="` (and every other lenient spelling
    of the same bytes) is refused; the blob as sealed opens."""
    summary = {**SUMMARY, "state": {**SUMMARY["state"], "pad": "x" * pad}}
    blob = KEY.seal("acme", summary)
    variants = lenient_spellings(blob)
    assert ("padding left off" in variants) == blob.endswith("=")
    for spelled in variants.values():
        with pytest.raises(CompactionError, match="not valid base64"):
            KEY.open("acme", spelled)
    assert KEY.open("acme", blob) == summary


def test_a_sealed_non_summary_is_refused() -> None:
    with pytest.raises(CompactionError, match="no compaction summary"):
        KEY.open("acme", KEY.seal("acme", {"state": {}}))  # no format
    with pytest.raises(CompactionError, match="format"):
        render_summary({"format": "prose", "text": "x"}, TokenCounter.for_model("gpt-4o"))


def test_a_key_is_32_bytes() -> None:
    with pytest.raises(ValueError):
        CompactionKey(b"short")


def test_the_summary_builds_on_the_previous_one() -> None:
    counter = TokenCounter.for_model("gpt-4o")
    first = compaction_summary([assistant("The refund REF-1 is on hold.")])
    second = compaction_summary([assistant("Shipping to Lyon is confirmed.")], first)
    text = render_summary(second, counter)
    assert text.startswith(SUMMARY_MARKER)
    assert "REF-1" in text and "Lyon" in text
    assert second["state"]["count"] == 2


def test_covered_keeps_users_instructions_and_split_pairs() -> None:
    items = [
        responses_item({"role": "system", "content": "Be brief."}),
        user("hi"),
        assistant("hello"),
        call("c1"),
        output("c1"),
        call("c2"),
        user("next"),
        output("c2"),
    ]
    end = current_turn_start(items)
    assert end == 6
    assert covered(items, end) == [2, 3, 4]  # c2's call stays with its later output
    # A summary this module rendered is covered (the new summary includes it).
    with_summary = [summary_message("earlier"), *items]
    assert covered(with_summary, end + 1)[0] == 0


def test_a_kept_call_keeps_the_reasoning_item_before_it() -> None:
    reasoning = responses_item({"type": "reasoning", "id": "rs_1", "summary": []})
    items = [user("a"), assistant("b"), reasoning, call("c1"), user("c"), output("c1")]
    assert covered(items, 4) == [1]


def test_replaced_puts_the_summary_where_the_last_covered_item_was() -> None:
    items = [user("a"), assistant("b"), call("c1"), output("c1"), user("d")]
    summary = summary_message("gist")
    pairs = replaced(items, 4, summary)
    assert [index for index, _ in pairs] == [0, 3, 4]
    assert pairs[1][1] is summary
    only_users = [user("a")]
    assert replaced(only_users, 1, summary) == [(0, only_users[0])]  # nothing to cover


def test_compacted_output_is_the_user_messages_then_the_item() -> None:
    item = KEY.item("acme", SUMMARY)
    out = compacted_output([user("a"), assistant("b"), user("c")], item)
    assert out == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "c"}]},
        item,
    ]


KINDS = st.sampled_from(["user", "assistant", "call", "output"])


@given(st.lists(KINDS, max_size=30), st.integers(min_value=0, max_value=30))
def test_a_compaction_never_splits_a_call_from_its_output(kinds: list[str], end: int) -> None:
    items: list[Item] = []
    open_calls: list[str] = []
    for n, kind in enumerate(kinds):
        if kind == "call":
            open_calls.append(f"c{n}")
            items.append(call(f"c{n}"))
        elif kind == "output" and open_calls:
            items.append(output(open_calls.pop(0)))
        elif kind == "user":
            items.append(user(f"u{n}"))
        else:
            items.append(assistant(f"a{n}"))
    end = min(end, len(items))
    kept = [item for _, item in replaced(items, end, summary_message("s"))]
    calls = {c for item in kept for c in item.call_ids}
    outputs = {item.output_for for item in kept if item.output_for}
    answered = {item.output_for for item in items if item.output_for}
    assert outputs <= calls
    assert {c for c in calls if c in answered} <= outputs
    assert [i for i in kept if i.is_user_message] == [i for i in items if i.is_user_message]


def test_a_plan_is_what_the_summary_is_written_of_and_its_key() -> None:
    counter = TokenCounter.for_model("gpt-4o")
    first = compaction_summary([assistant("The refund REF-1 is on hold.")])
    digest = summary_message(render_summary(first, counter))
    items = [
        user("hello"),
        digest,  # the previous compaction, expanded: not read back a second time
        call("call_1"),
        output("call_1"),
        assistant("Shipping to Lyon is confirmed."),
        user("and now?"),
    ]
    plan = plan_compaction(items, 5, counter, first)
    assert plan is not None
    assert plan.gone == (1, 2, 3, 4)
    assert [item.kind for item in plan.items] == ["tool_calls", "tool_output", "message"]
    assert plan.base is not None and plan.base.count == 1
    # The deterministic summary is compaction_summary's, in the shape both kinds share.
    assert plan.summary() == compaction_summary(plan.items, first)
    assert plan.summary() == summary_of(memory.extract(plan.items, plan.base))
    # A state the summarizer wrote is sealed in the same shape; a malformed one is not.
    written = json.loads(memory.to_json(memory.MemoryState(count=4, decisions=("Ship it.",))))
    assert plan.summary(written) == {"format": "memory", "state": written}
    assert plan.summary({"count": -1}) == plan.summary()
    assert plan.summary({"decisions": "not a list"}) == plan.summary()
    previous = plan.previous_item(counter)
    assert previous is not None and "REF-1" in previous.text()
    # The key names the items, what they follow and the limit.
    assert plan.digest(2000) == plan_compaction(items, 5, counter, first).digest(2000)  # type: ignore[union-attr]
    assert plan.digest(2000) != plan.digest(1000)
    # Without `previous`, the expanded compaction is read back from its text instead.
    from_text = plan_compaction(items, 5, counter, None)
    assert from_text is not None and from_text.base == plan.base
    alone = [user("hello"), *items[2:]]
    assert plan.digest(2000) != plan_compaction(alone, 4, counter, None).digest(2000)  # type: ignore[union-attr]
    assert plan_compaction([user("hi"), user("again")], 2, counter, None) is None


def test_a_plan_without_a_previous_compaction_has_no_base() -> None:
    counter = TokenCounter.for_model("gpt-4o")
    plan = plan_compaction([assistant("ok"), user("next")], 1, counter, None)
    assert plan is not None and plan.base is None and plan.previous_item(counter) is None
