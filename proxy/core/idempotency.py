"""Request idempotency rules: the `Idempotency-Key` header (SPEC section 1).

Semantics of the IETF draft "The Idempotency-Key HTTP Header Field", with Stripe's
choices where the draft leaves room: per tenant, the first request with a key runs and
its response is stored; a retry with the same key and the same body gets the stored
response (no second provider call); the same key with another body is a 422; the same
key while the first request still runs is a 409. Transient failures are not stored, so
a retry can still succeed.

The edge::

    problem = validate_key(header)                    # 400 when not None
    print_ = fingerprint(request.method, request.path, body)
    existing = await store.idempotency_begin(IdempotencyRecord(..., fingerprint=print_,
        status="running", expires_at=expires_at(now, policy.retention_seconds)))
    match verdict((existing.fingerprint, existing.status) if existing else None, print_): ...
    # after running: should_store(status) ? idempotency_finish(...) : idempotency_abort(...)
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from datetime import UTC, datetime, timedelta
from typing import Literal

from proxy.core.items import canonical_json

MAX_KEY_LENGTH = 255
RecordStatus = Literal["running", "done"]


def fingerprint(method: str, path: str, body: bytes) -> str:
    """Hex sha256 of the request: key order and whitespace of a JSON body do not count.

    A body that is not JSON (or not UTF-8) is hashed as its bytes; it cannot collide
    with a canonical JSON body because canonical JSON always parses.
    """
    digest = hashlib.sha256()
    for part in (method.upper().encode(), path.encode(), _canonical_body(body)):
        digest.update(len(part).to_bytes(8, "big"))  # length-prefixed: no ambiguous joins
        digest.update(part)
    return digest.hexdigest()


def _canonical_body(body: bytes) -> bytes:
    try:
        # surrogatepass: JSON may escape a lone surrogate ("\ud800"), which UTF-8 refuses
        return canonical_json(json.loads(body)).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):  # not JSON, or nested too deep to canonicalize
        return body


def validate_key(value: str) -> str | None:
    """None when the header value can be a key, else the problem (for a 400)."""
    if not value.strip():
        return "Idempotency-Key is empty"
    if len(value) > MAX_KEY_LENGTH:
        return f"Idempotency-Key is longer than {MAX_KEY_LENGTH} characters"
    if not all(" " <= char <= "~" for char in value):
        return "Idempotency-Key must be printable ASCII"
    return None


class Verdict(enum.Enum):
    RUN = "run"  # first use of the key: run the request
    REPLAY = "replay"  # same key, same body, done: return the stored response
    CONFLICT_BODY = "conflict_body"  # same key, other body: 422
    IN_PROGRESS = "in_progress"  # same key, same body, still running: 409


def verdict(existing: tuple[str, RecordStatus] | None, fingerprint: str) -> Verdict:
    """What to do with a request, given the unexpired (fingerprint, status) of its key.

    A different body wins over "still running": that request can never be replayed, so
    the client learns it is wrong at once instead of retrying a 409.
    """
    if existing is None:
        return Verdict.RUN
    stored_fingerprint, status = existing
    if stored_fingerprint != fingerprint:
        return Verdict.CONFLICT_BODY
    return Verdict.IN_PROGRESS if status == "running" else Verdict.REPLAY


# Statuses that say "try again later": storing them would replay the failure forever.
_TRANSIENT_4XX = frozenset({408, 425, 429})


def should_store(status: int) -> bool:
    """Whether a response is kept for replay: 2xx and 4xx, except the transient ones.

    5xx, 408 Request Timeout, 425 Too Early and 429 Too Many Requests are not stored
    (the record is aborted), so the client's retry with the same key runs again. Other
    4xx are answers about the request itself and replay as they are (Stripe does the same).
    """
    return 200 <= status < 300 or (400 <= status < 500 and status not in _TRANSIENT_4XX)


_FRACTION = re.compile(r"[Tt ]\d\d:\d\d:\d\d[.,](\d+)")


def expires_at(now_iso: str, retention_seconds: int) -> str:
    """`now_iso` plus the retention, in UTC, formatted like the input.

    The store compares these strings, so the output keeps the input's shape: its
    fraction digits and its "Z" or "+00:00" suffix (a naive input is taken as UTC and
    stays naive). Offsets other than UTC are converted to UTC.
    """
    moment = datetime.fromisoformat(now_iso)
    naive = moment.tzinfo is None
    if not naive:
        moment = moment.astimezone(UTC)
    later = moment + timedelta(seconds=retention_seconds)
    separator = now_iso[10] if len(now_iso) > 10 else "T"
    text = later.strftime(f"%Y-%m-%d{separator}%H:%M:%S")
    if fraction := _FRACTION.search(now_iso):
        text += "." + f"{later.microsecond:06d}".ljust(len(fraction[1]), "0")[: len(fraction[1])]
    if naive:
        return text
    return text + ("Z" if now_iso.endswith(("Z", "z")) else "+00:00")
