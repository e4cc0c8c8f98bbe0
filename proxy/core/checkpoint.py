"""The thread state / checkpoint (SPEC section 2, layer 2) as JSON, and back.

A thread's state holds the sticky cut of its last projection (SPEC section 5): where the
verbatim window starts (`window_start`, the key the store's `load_window` reads), what
stands for everything before it (`summary`: carried pinned items and the chain of summary
blocks, in the order they are sent; a state written before the chain holds one block,
which reads as a chain of one), the full-room form of a last block that was sent smaller
(`summary_deferred`, absent when none), how many of the summary's first items are the
thread's opening turns kept verbatim (`summary_opening`, absent when none) and the
compressed forms of tool results (`compressed`). Positions are the thread's log
positions. Other keys of the state belong to other features and are kept untouched.

>>> cut = CutPoint(4, (chat_item({"role": "system", "content": "Be brief."}),))
>>> state_to_cut(cut_to_state(cut)) == cut
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.core.items import Item, JsonDict, item_of
from proxy.core.projection import CutPoint

WINDOW_START = "window_start"
SUMMARY = "summary"
COMPRESSED = "compressed"
DEFERRED = "summary_deferred"
OPENING = "summary_opening"


def cut_to_state(cut: CutPoint | None, base: Mapping[str, Any] | None = None) -> JsonDict:
    """`base` with its cut replaced by `cut` (None keeps the base's cut as it is)."""
    state: JsonDict = dict(base or {})
    if cut is None:
        return state
    state[WINDOW_START] = cut.start
    state[SUMMARY] = [_item_json(item) for item in cut.summary]
    state[COMPRESSED] = [
        {"position": position, **_item_json(item)} for position, item in cut.compressed
    ]
    if cut.deferred is not None:
        state[DEFERRED] = _item_json(cut.deferred)
    else:
        state.pop(DEFERRED, None)
    if cut.opening:
        state[OPENING] = cut.opening
    else:
        state.pop(OPENING, None)
    return state


def without_cut(state: Mapping[str, Any]) -> JsonDict:
    """`state` with no cut: the thread is projected again from its whole log (an item
    left it, and the cut's summaries may quote it)."""
    return {
        k: v
        for k, v in state.items()
        if k not in (WINDOW_START, SUMMARY, COMPRESSED, DEFERRED, OPENING)
    }


def state_to_cut(state: Mapping[str, Any]) -> CutPoint | None:
    """The cut a state holds; None for a thread that was never trimmed."""
    start = state.get(WINDOW_START)
    if not isinstance(start, int):
        return None
    summary = tuple(_item(entry) for entry in state.get(SUMMARY) or ())
    compressed = tuple(
        (int(entry["position"]), _item(entry)) for entry in state.get(COMPRESSED) or ()
    )
    deferred = state.get(DEFERRED)
    opening = state.get(OPENING)
    return CutPoint(
        start,
        summary,
        compressed,
        _item(deferred) if deferred else None,
        opening if isinstance(opening, int) and 0 < opening <= len(summary) else 0,
    )


def _item_json(item: Item) -> JsonDict:
    return {"api": item.api, "raw": item.raw}


def _item(entry: Mapping[str, Any]) -> Item:
    api = entry.get("api")
    return item_of(api if isinstance(api, str) else None, entry["raw"])
