"""Forms that are stored and compared across processes and versions keep their bytes.

Item digests (column `items.digest`), ledger fallback keys and Idempotency-Key
fingerprints are written by one version and compared by the next: the values below were
computed before orjson entered the hot path and must never change. The fast paths
(`canonical_bytes`, `fastjson.loads`) are checked against the stdlib on generated values.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import fastjson, items
from proxy.core.idempotency import fingerprint
from proxy.core.items import canonical_bytes, canonical_json, content_digest
from proxy.core.ledger import arguments_digest

TRICKY = {
    "role": "user",
    "content": [
        {
            "type": "text",
            "text": 'héllo \u2028 "q" \\ \n',
            "n": 1.5e-7,
            "big": 12345678901234567890123,
            "f": None,
        }
    ],
    "z": True,
    "a": -0.0,
}


def test_item_digests_are_pinned() -> None:
    assert content_digest(TRICKY) == (
        "7d6cc0b3d33d31ed58746575c35d2843d1ff9569bc9a3cbc5ae9d872af4ae1a2"
    )
    assert content_digest({"role": "user", "content": "hi"}) == (
        "9017285104d1b249960a30732b8e92f6e2fb3acf8d8e4b2a16c116ad0c1ed211"
    )
    assert content_digest({"text": "\ud800", "x": float("nan")}) == (
        "f78069f54a9204023e2a83a17c59f9a247f7080aab12839b57e1e99982c56ede"
    )


def test_canonical_json_is_pinned() -> None:
    assert canonical_json(TRICKY) == (
        '{"a":-0.0,"content":[{"big":12345678901234567890123,"f":null,"n":1.5e-07,'
        '"text":"héllo \u2028 \\"q\\" \\\\ \\n","type":"text"}],"role":"user","z":true}'
    )


def test_idempotency_fingerprint_is_pinned() -> None:
    body = b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi \\u00e9", "t": 0.1}]}'
    assert fingerprint("post", "/v1/chat/completions", body) == (
        "fff938f236ae7463833b75a22d932eed1b1c98bcef0fe8f18b35bac1a469f0df"
    )


def test_ledger_fallback_digest_is_pinned() -> None:
    assert arguments_digest('{"b": 2, "a": [1, 2.50, "\\u00e9"]}') == (
        "93ad4be4f3a50904e028d9f647d86e61bc8e832a5460991880a581398c58d45d"
    )


# Everything a JSON document can hold, plus what the stdlib also writes (NaN, infinities,
# lone surrogates, integers past 64 bits) and text that looks like numbers or null.
_text = st.one_of(
    st.text(),
    st.sampled_from(["1.5", "2e10", "null", '\\"', "\\", "\ud800", "\x00", "\u2028", "é"]),
)
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    _text,
)
json_values = st.recursive(
    _scalar,
    lambda children: st.one_of(
        st.lists(children, max_size=5), st.dictionaries(_text, children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=500)
@given(json_values)
def test_canonical_bytes_equal_the_stdlib_form(value: Any) -> None:
    assert canonical_bytes(value) == canonical_json(value).encode("utf-8", "surrogatepass")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


@settings(max_examples=500)
@given(json_values, st.booleans())
def test_fast_loads_equals_the_stdlib(value: Any, as_bytes: bool) -> None:
    text = json.dumps(value, ensure_ascii=as_bytes)
    try:
        expected = json.loads(text)
    except ValueError:
        return
    source: str | bytes = text.encode("utf-8") if as_bytes else text
    assert _same(fastjson.loads(source), expected)


def _stdlib_digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode("utf-8", "surrogatepass")).hexdigest()


@settings(max_examples=500)
@given(json_values)
def test_a_digest_seen_before_is_the_same(value: Any) -> None:
    assert content_digest(value) == content_digest(value) == _stdlib_digest(value)


def test_values_orjson_writes_alike_keep_their_own_digests() -> None:
    """orjson writes None, NaN and the infinities all as null, and 1e16 as the stdlib's
    1e+16 differently: digests remembered by orjson's form must not mix them."""
    for value in [None, math.nan, math.inf, -math.inf, None, 1e16, 1e16, 1.0, 1, 1.0]:
        for wrapped in ({"a": value}, [value, "x"]):
            assert content_digest(wrapped) == _stdlib_digest(wrapped)


def test_remembered_digests_stay_bounded() -> None:
    for index in range(items.DIGESTS_MAX_ENTRIES + 10):
        content_digest({"n": index})
    assert 0 < len(items._DIGESTS) <= items.DIGESTS_MAX_ENTRIES
    long = {"text": "x" * items.DIGESTS_MAX_LENGTH}
    assert content_digest(long) == _stdlib_digest(long)
    assert orjson.dumps(long, option=orjson.OPT_SORT_KEYS) not in items._DIGESTS
