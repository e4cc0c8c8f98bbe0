"""The provider's body of a stored turn (proxy/server/turn.py, `history_spliced`): the
window's items' JSON is kept from one turn to the next and the body written around it,
byte for byte what `fastjson.dumps` writes for the whole body."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import fastjson
from proxy.core.items import Item, responses_item
from proxy.server.turn import SENT_PARTS, history_spliced
from proxy.threads import Loaded

JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)  # past 64 bits orjson refuses
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
JSON = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
ITEM = st.builds(
    lambda text, extra: {"role": "user", "content": text, **({"x": extra} if extra else {})},
    st.text(max_size=12),
    st.none() | JSON,
)
FIELDS = st.dictionaries(
    st.sampled_from(["model", "tools", "store", "include", "metadata", "z"]), JSON, max_size=4
)


def body(fields: dict[str, Any], at: int, items: tuple[Item, ...]) -> dict[str, Any]:
    """`fields` with "input" (the raws of `items`) at position `at`."""
    pairs = list(fields.items())
    at = min(at, len(pairs))
    return dict([*pairs[:at], ("input", [item.raw for item in items]), *pairs[at:]])


@settings(max_examples=200, deadline=None)
@given(
    turns=st.lists(st.tuples(st.lists(ITEM, max_size=4), st.lists(ITEM, max_size=3)), max_size=4),
    fields=FIELDS,
    at=st.integers(min_value=0, max_value=5),
)
def test_a_growing_window_gets_the_bytes_of_the_whole_body(
    turns: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]],
    fields: dict[str, Any],
    at: int,
) -> None:
    """Turn after turn the window grows by what was stored (new Item objects, as a
    window read again holds) and each turn adds new items: every body is fastjson's."""
    memo: dict[str, Any] = {}
    window: tuple[Item, ...] = ()
    for stored, new in turns:
        window = (*window, *map(responses_item, stored))
        loaded = Loaded("t", "th", "conversation", None, items=window, memo=memo)
        items = (*window, *map(responses_item, new))
        sent = body(fields, at, items)
        assert history_spliced(sent, "input", items, loaded) == fastjson.dumps(sent)


def test_a_window_of_other_items_is_written_anew() -> None:
    """Parts kept for other Item objects (a window read whole again, an item erased) are
    not reused, even for equal raws."""
    memo: dict[str, Any] = {}
    first = tuple(responses_item({"role": "user", "content": c}) for c in "ab")
    loaded = Loaded("t", "th", "conversation", None, items=first, memo=memo)
    sent = body({"model": "m"}, 1, first)
    history_spliced(sent, "input", first, loaded)
    assert memo[SENT_PARTS][0] is first
    other = (responses_item({"role": "user", "content": "x"}), first[1])
    memo[SENT_PARTS] = (first, (b'{"stale":1}', memo[SENT_PARTS][1][1]))
    again = Loaded("t", "th", "conversation", None, items=other, memo=memo)
    sent = body({"model": "m"}, 1, other)
    assert history_spliced(sent, "input", other, again) == fastjson.dumps(sent)


def test_a_history_that_is_not_the_items_raws_is_written_whole() -> None:
    items = (responses_item({"role": "user", "content": "a"}),)
    loaded = Loaded("t", "th", "conversation", None, items=items)
    sent = {"model": "m", "input": [{"role": "user", "content": "b"}]}
    assert history_spliced(sent, "input", items, loaded) == fastjson.dumps(sent)
    assert SENT_PARTS not in loaded.memo
