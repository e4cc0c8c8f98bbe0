"""The checkpoint: a thread's sticky cut survives the trip through the store's JSON."""

from __future__ import annotations

import json

from proxy.core.checkpoint import cut_to_state, state_to_cut
from proxy.core.items import chat_item, responses_item
from proxy.core.memory import SUMMARY_MARKER
from proxy.core.projection import CutPoint


def test_chat_cut_round_trips_through_json() -> None:
    cut = CutPoint(
        7,
        (
            chat_item({"role": "system", "content": "All prices in CNY."}),
            chat_item({"role": "system", "content": f"{SUMMARY_MARKER}\nuser asked for X"}),
        ),
        ((9, chat_item({"role": "tool", "tool_call_id": "call_1", "content": "{...}"})),),
    )
    state = json.loads(json.dumps(cut_to_state(cut)))
    assert state["window_start"] == 7
    assert state_to_cut(state) == cut


def test_responses_cut_round_trips_with_item_views() -> None:
    output = {"type": "function_call_output", "call_id": "call_9", "output": "short"}
    cut = CutPoint(
        3,
        (responses_item({"role": "developer", "content": "Be brief."}),),
        ((4, responses_item(output)),),
    )
    back = state_to_cut(json.loads(json.dumps(cut_to_state(cut))))
    assert back == cut
    assert back is not None and back.compressed[0][1].output_for == "call_9"


def test_other_state_keys_are_kept_and_no_cut_changes_nothing() -> None:
    base = {"pending_calls": ["call_1"]}
    assert cut_to_state(None, base) == base
    state = cut_to_state(CutPoint(2, ()), base)
    assert state["pending_calls"] == ["call_1"]
    assert state_to_cut(base) is None
    assert state_to_cut({}) is None


def test_a_state_stored_before_the_chain_reads_as_a_chain_of_one() -> None:
    """Threads stored before the summary chain hold pinned items then one digest."""
    digest = {"role": "system", "content": f"{SUMMARY_MARKER} Stands for 13 earlier items."}
    state = {
        "window_start": 14,
        "summary": [
            {"api": "chat", "raw": {"role": "system", "content": "Be brief."}},
            {"api": "chat", "raw": digest},
        ],
        "compressed": [],
    }
    cut = state_to_cut(state)
    assert cut is not None and cut.deferred is None
    assert [item.raw for item in cut.chain] == [digest]
    assert cut_to_state(cut) == state  # written back unchanged: no new key


def test_chain_and_deferred_block_round_trip() -> None:
    blocks = [
        chat_item({"role": "system", "content": f"{SUMMARY_MARKER} Stands for {n} earlier items."})
        for n in (5, 7)
    ]
    pinned = chat_item({"role": "system", "content": "All prices in CNY."})
    full = chat_item(
        {"role": "system", "content": f"{SUMMARY_MARKER} Stands for 7 earlier items.\n- more"}
    )
    cut = CutPoint(30, (blocks[0], pinned, blocks[1]), (), full)
    state = json.loads(json.dumps(cut_to_state(cut, {"other": 1})))
    back = state_to_cut(state)
    assert back == cut and back is not None
    assert back.chain == tuple(blocks) and back.deferred == full
    without = cut_to_state(CutPoint(31, cut.summary), state)
    assert "summary_deferred" not in without and without["other"] == 1
