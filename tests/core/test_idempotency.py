"""Request Idempotency-Key rules: fingerprints, key validation, verdicts, what is stored,
and expiry times (SPEC section 1, IETF draft "The Idempotency-Key HTTP Header Field")."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.idempotency import (
    MAX_KEY_LENGTH,
    Verdict,
    expires_at,
    fingerprint,
    should_store,
    validate_key,
    verdict,
)

BODY = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}

# --- fingerprint ---------------------------------------------------------------------------


def test_reordered_and_respaced_json_has_the_same_fingerprint() -> None:
    compact = json.dumps(BODY, separators=(",", ":")).encode()
    reordered = json.dumps(dict(reversed(BODY.items())), indent=4).encode()
    assert fingerprint("POST", "/v1/chat/completions", compact) == fingerprint(
        "POST", "/v1/chat/completions", reordered
    )


def test_method_case_does_not_count() -> None:
    body = json.dumps(BODY).encode()
    assert fingerprint("post", "/v1/x", body) == fingerprint("POST", "/v1/x", body)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/chat/completions", {**BODY, "temperature": 1}),
        ("POST", "/v1/chat/completions", {**BODY, "messages": []}),
        ("POST", "/v1/responses", BODY),
        ("PUT", "/v1/chat/completions", BODY),
    ],
)
def test_a_different_request_has_a_different_fingerprint(
    method: str, path: str, body: dict[str, Any]
) -> None:
    original = fingerprint("POST", "/v1/chat/completions", json.dumps(BODY).encode())
    assert fingerprint(method, path, json.dumps(body).encode()) != original


def test_json_values_are_not_normalized_beyond_key_order() -> None:
    # 1 and 1.0 are different requests as far as the provider is concerned
    assert fingerprint("POST", "/v1/x", b'{"n": 1}') != fingerprint("POST", "/v1/x", b'{"n": 1.0}')


def test_non_json_bodies_are_hashed_as_bytes() -> None:
    assert fingerprint("POST", "/v1/files", b"\xff\x00raw") == fingerprint(
        "POST", "/v1/files", b"\xff\x00raw"
    )
    assert fingerprint("POST", "/v1/files", b"a b") != fingerprint("POST", "/v1/files", b"a  b")
    assert fingerprint("POST", "/v1/files", b"") != fingerprint("POST", "/v1/files", b"{}")


def test_parts_do_not_run_into_each_other() -> None:
    assert fingerprint("POST", "/v1/a", b"bc") != fingerprint("POST", "/v1/ab", b"c")


def test_lone_surrogate_escapes_still_canonicalize() -> None:
    assert fingerprint("POST", "/v1/x", b'{"b":1,"a":"\\ud800"}') == fingerprint(
        "POST", "/v1/x", b'{"a": "\\ud800", "b": 1}'
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


def shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        items = [(key, shuffled(inner, rng)) for key, inner in value.items()]
        rng.shuffle(items)
        return dict(items)
    if isinstance(value, list):
        return [shuffled(inner, rng) for inner in value]
    return value


@given(
    st.dictionaries(st.text(max_size=8), json_values, max_size=6), st.randoms(use_true_random=False)
)
def test_fingerprint_ignores_key_order_at_every_depth(body: dict[str, Any], rng: Any) -> None:
    other = json.dumps(
        shuffled(body, rng), indent=rng.choice([None, 1]), ensure_ascii=rng.choice([True, False])
    )
    assert fingerprint("POST", "/v1/responses", other.encode()) == fingerprint(
        "POST", "/v1/responses", json.dumps(body).encode()
    )


# --- validate_key --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["8e03978e-40d5-43e8-bc93-6894a57f9324", "a", "k" * MAX_KEY_LENGTH, "a b~!"]
)
def test_acceptable_keys(key: str) -> None:
    assert validate_key(key) is None


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("k" * (MAX_KEY_LENGTH + 1), "longer than 255"),
        ("clé", "printable ASCII"),
        ("a\tb", "printable ASCII"),
        ("a\x7fb", "printable ASCII"),
    ],
)
def test_unacceptable_keys(key: str, problem: str) -> None:
    assert problem in (validate_key(key) or "")


# --- verdict -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("existing", "expected"),
    [
        (None, Verdict.RUN),
        (("fp", "done"), Verdict.REPLAY),
        (("fp", "running"), Verdict.IN_PROGRESS),
        (("other", "done"), Verdict.CONFLICT_BODY),
        (("other", "running"), Verdict.CONFLICT_BODY),
    ],
)
def test_verdict_table(existing: Any, expected: Verdict) -> None:
    assert verdict(existing, "fp") is expected


# --- should_store --------------------------------------------------------------------------


@pytest.mark.parametrize("status", [200, 201, 204, 299, 400, 401, 404, 409, 413, 422, 499])
def test_final_answers_are_stored(status: int) -> None:
    assert should_store(status)


@pytest.mark.parametrize("status", [100, 302, 408, 425, 429, 500, 502, 503, 504, 599])
def test_transient_answers_are_not_stored(status: int) -> None:
    assert not should_store(status)


# --- expires_at ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "seconds", "expected"),
    [
        ("2026-09-01T09:00:01+00:00", 86_400, "2026-09-02T09:00:01+00:00"),
        ("2026-12-31T23:59:59Z", 2, "2027-01-01T00:00:01Z"),
        ("2026-09-01T09:00:01.123456+00:00", 60, "2026-09-01T09:01:01.123456+00:00"),
        ("2026-09-01T09:00:01.120+00:00", 60, "2026-09-01T09:01:01.120+00:00"),
        ("2026-09-01T09:00:01+08:00", 3_600, "2026-09-01T02:00:01+00:00"),
        ("2026-09-01T09:00:01", 1, "2026-09-01T09:00:02"),
        ("2026-09-01 09:00:01+00:00", 1, "2026-09-01 09:00:02+00:00"),
        ("2028-02-28T12:00:00+00:00", 86_400, "2028-02-29T12:00:00+00:00"),
    ],
)
def test_expires_at(now: str, seconds: int, expected: str) -> None:
    assert expires_at(now, seconds) == expected


@given(st.datetimes(max_value=datetime(9000, 1, 1), timezones=st.just(UTC)), st.integers(0, 10**8))
def test_expiry_strings_sort_like_times(moment: datetime, seconds: int) -> None:
    # the store compares these as strings (expires_at < now)
    now = moment.isoformat(timespec="seconds")
    assert expires_at(now, seconds) >= now
    assert expires_at(now, seconds + 1) > expires_at(now, seconds)
