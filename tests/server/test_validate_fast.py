"""The orjson door of `read_json_object` takes only what the stdlib parses to the same
value and what the stricter checks would pass; everything else goes the old way."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.server.validate import MAX_JSON_DEPTH, plainly_valid
from tests.core.test_persisted_forms import _same, json_values


def _standard(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return not any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, list):
        return all(_standard(v) for v in value)
    if isinstance(value, dict):
        return all(_standard(k) and _standard(v) for k, v in value.items())
    return True


@settings(max_examples=500)
@given(json_values, st.booleans())
def test_fast_door_agrees_with_the_stdlib(value: Any, ascii_only: bool) -> None:
    text = json.dumps({"v": value, "id": value}, ensure_ascii=ascii_only)
    fast = plainly_valid(text.encode("utf-8", "surrogatepass"))
    if fast is None:
        return
    assert _same(fast, json.loads(text))
    assert _standard(fast)


def test_integers_beyond_64_bits_keep_every_digit() -> None:
    assert plainly_valid(b'{"n": [123456789012345678901234567890]}') is None
    assert plainly_valid(b'{"n": -9223372036854775809}') is None
    assert plainly_valid(b'{"n": 18446744073709551615}') == {"n": 18446744073709551615}


def test_what_the_checks_refuse_takes_the_slow_door() -> None:
    assert plainly_valid(b'{"input": [{"id": "a\\u0000b"}]}') is None
    assert plainly_valid(b'{"name": "' + b"x" * 513 + b'"}') is None
    deep = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert plainly_valid(b'{"a": ' + deep + b"}") is None
    assert plainly_valid(b'{"a": ' + deep[1:-1] + b"}") is not None
    assert plainly_valid(b"[1]") is None
