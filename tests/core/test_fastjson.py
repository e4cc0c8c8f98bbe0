"""fastjson.dumps writes what the stdlib reads back as the same value, including what
orjson refuses to write."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import fastjson

from .test_persisted_forms import _same as same  # equal, of the same types throughout


def json_of(scalars: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Lists and objects nested around `scalars`."""
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=20,
    )


json_values = json_of(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
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


@settings(max_examples=300, derandomize=True)
@given(json_values)
def test_loads_gives_the_stdlibs_value(value: Any) -> None:
    text = json.dumps(value)
    assert same(fastjson.loads(text), json.loads(text))
    assert same(fastjson.loads(text.encode()), json.loads(text.encode()))


@pytest.mark.parametrize(
    "text",
    [
        "12345678901234567890123",  # beyond 64 bits: orjson gives a float
        "-9223372036854775809",
        '{"a": [1, 18446744073709551616]}',
        "9223372036854775807",  # 19 digits, within 64 bits
        "1234567890123456789.5",
        "[1.0000000000000000000001]",
        '{"id": "1234567890123456789012"}',  # a long run inside a string
        "NaN",
        "[Infinity, -Infinity]",
        "1e400",
        '"\\ud800 lone"',  # an escaped lone surrogate: orjson refuses it
        '{"k": "\u00e9\u4e2d\U0001f600", "n": 3}',
        '{"k": "\u0663\u0663\u0663\u0663\u0663\u0663\u0663\u0663\u0663\u0663"}',
        '{"a": 1, "a": 2}',  # the last duplicate wins in both
        " [1] ",
    ],
)
def test_loads_where_orjson_would_differ(text: str) -> None:
    assert same(fastjson.loads(text), json.loads(text))
    assert same(fastjson.loads(text.encode()), json.loads(text.encode()))


@pytest.mark.parametrize(
    "text",
    ["", "{", "[1,]", '{"a" 1}', "\ufeff{}", "tru", "01"],
)
def test_loads_raises_where_the_stdlib_raises(text: str) -> None:
    with pytest.raises(ValueError) as expected:
        json.loads(text)
    with pytest.raises(type(expected.value)):
        fastjson.loads(text)


def test_loads_takes_a_str_holding_a_lone_surrogate_as_the_stdlib_does() -> None:
    text = '["\ud800"]'  # the surrogate itself, not escaped: no UTF-8 for orjson
    assert same(fastjson.loads(text), json.loads(text))


@pytest.mark.parametrize(
    "data",
    [
        '{"a": "\u00e9"}'.encode("utf-16"),  # the stdlib detects UTF-16 and 32 in bytes
        b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 byte order mark
    ],
)
def test_loads_reads_the_encodings_the_stdlib_reads(data: bytes) -> None:
    assert same(fastjson.loads(data), json.loads(data))


def test_loads_refuses_bytes_that_are_not_utf8_as_the_stdlib_does() -> None:
    with pytest.raises(UnicodeDecodeError):
        json.loads(b'{"a": "\xff"}')
    with pytest.raises(UnicodeDecodeError):
        fastjson.loads(b'{"a": "\xff"}')


stored_values = json_of(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**70)
    | st.floats()  # NaN and infinities included: orjson would write them as null
    | st.text()
)


@settings(max_examples=500, derandomize=True)
@given(stored_values)
def test_dumps_text_reads_back_as_the_value_itself(value: Any) -> None:
    text = fastjson.dumps_text(value)
    assert same(json.loads(text), value)
    assert same(fastjson.loads(text), value)


@pytest.mark.parametrize(
    "value",
    [
        {"score": float("nan"), "id": None},  # orjson writes NaN as null
        [float("inf"), None, float("-inf")],
        {"n": 10**40},  # beyond 64 bits: orjson refuses
        {"text": "\ud800 lone"},  # a lone surrogate: orjson refuses
        {1: "a non-string key"},  # the stdlib writes it as "1"
        {"pair": (1, None)},  # a tuple reads back as a list, as from the stdlib's text
    ],
)
def test_dumps_text_keeps_the_stdlibs_text_where_orjson_would_differ(value: Any) -> None:
    assert fastjson.dumps_text(value) == json.dumps(value, separators=(",", ":"))


def test_dumps_text_is_utf8_text_in_insertion_order() -> None:
    assert fastjson.dumps_text({"b": "é", "a": [1.5, None]}) == '{"b":"é","a":[1.5,null]}'
