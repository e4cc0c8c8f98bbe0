"""fastjson.dumps writes what the stdlib reads back as the same value, including what
orjson refuses to write."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import fastjson

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, derandomize=True)
@given(json_values)
def test_dumps_round_trips_through_the_stdlib(value: Any) -> None:
    assert json.loads(fastjson.dumps(value)) == value


@pytest.mark.parametrize(
    "value",
    [
        {"n": 10**40},  # beyond 64 bits: orjson refuses
        {"text": "\ud800 lone"},  # a lone surrogate: orjson refuses
    ],
)
def test_dumps_falls_back_where_orjson_refuses(value: Any) -> None:
    assert json.loads(fastjson.dumps(value)) == value
