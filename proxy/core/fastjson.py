"""`json.loads` with orjson's speed, and exactly the stdlib's result.

orjson parses most documents to the same values, faster. Where it differs it either
raises (NaN / Infinity literals, escaped lone surrogates, numbers that overflow a
double, text that is not UTF-8) or, for integers beyond 64 bits, silently returns a
float: a run of 19 or more digits anywhere sends the text to the stdlib instead, and so
does every orjson error (the stdlib then accepts or raises as it always did).

>>> loads('{"a": [1, 2.5, null]}')
{'a': [1, 2.5, None]}
>>> loads("12345678901234567890123")
12345678901234567890123
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_LONG_NUMBER = re.compile(r"\d{19}")
_LONG_NUMBER_BYTES = re.compile(rb"\d{19}")


def loads(text: str | bytes) -> Any:
    if isinstance(text, str):
        long_number = _LONG_NUMBER.search(text) is not None
    else:
        long_number = _LONG_NUMBER_BYTES.search(text) is not None
    if long_number:
        return json.loads(text)
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def dumps(value: Any) -> bytes:
    """Compact JSON bytes for the wire (the provider's request, a rewritten answer or
    event), with orjson's speed. Not for persisted canonical forms (digests, keys,
    fingerprints: core.items.canonical_bytes) — orjson's float text is its own. Where
    orjson refuses (integers beyond 64 bits, lone surrogates) the stdlib writes it."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(value, separators=(",", ":")).encode()
