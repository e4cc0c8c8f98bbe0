"""`json.loads` with orjson's speed, and exactly the stdlib's result.

orjson parses most documents to the same values, faster. Where it differs it either
raises (NaN / Infinity literals, escaped lone surrogates, numbers that overflow a
double, text that is not UTF-8) or, for integers beyond 64 bits, silently returns a
float: a run of 19 or more digits anywhere sends the text to the stdlib instead, and so
does every orjson error (the stdlib then accepts or raises as it always did).

The run is found by mapping every digit to "0" (`bytes.translate`, one C pass over the
UTF-8 bytes) and searching for nineteen zeros: a regular expression (`[0-9]{19}`) scanned
the text position by position and cost more than `json.loads` itself on item-sized
documents. Digits outside ASCII cannot be part of a JSON number, so only these count.

>>> loads('{"a": [1, 2.5, null]}')
{'a': [1, 2.5, None]}
>>> loads("12345678901234567890123")
12345678901234567890123
"""

from __future__ import annotations

import json
from typing import Any

import orjson

# What the stdlib cannot write (dataclasses, datetimes, subclasses) must not pass either.
_STDLIB_TYPES_ONLY = (
    orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19  # 2**63 has 19 digits: anything shorter fits orjson's integers


def loads(text: str | bytes) -> Any:
    if isinstance(text, str):
        try:
            data = text.encode()
        except UnicodeEncodeError:  # a lone surrogate in the str: orjson refuses it
            return json.loads(text)
    else:
        data = text
    if _LONG_RUN in data.translate(_DIGITS_TO_ZERO):
        return json.loads(text)
    try:
        return orjson.loads(data)
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


def dumps_text(value: Any) -> str:
    """Compact JSON text that `loads` and the stdlib read back as `value` itself: what a
    store column keeps (proxy/store/sql.py). orjson writes it, UTF-8 and in insertion
    order, except where it would not give `value` back: it refuses integers beyond 64
    bits, lone surrogates and non-string keys, and writes NaN and infinities as null (a
    text holding a null is read back and compared). Those keep the stdlib's text, ASCII
    escaped as the store always wrote it. Float text may differ from the stdlib's; the
    float it reads back is the same (tests/core/test_fastjson.py)."""
    try:
        fast = orjson.dumps(value, option=_STDLIB_TYPES_ONLY)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(value, separators=(",", ":"))
    if b"null" in fast and orjson.loads(fast) != value:  # a NaN, an infinity, a tuple
        return json.dumps(value, separators=(",", ":"))
    return fast.decode()
