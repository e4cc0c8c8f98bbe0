"""Hostile bytes on every route threadkeeper serves itself, over a real socket.

Bodies (deep nesting, huge strings and integer literals, NaN/Infinity, lone surrogates in
content, keys and ids, NUL in ids, invalid UTF-8, duplicate item ids, wrong types, empty
and non-object bodies), path ids (invalid UTF-8, NUL, huge) and headers (invalid UTF-8 in
Authorization, X-Thread-Id and Idempotency-Key, huge values) are written byte for byte.
For every one of them:

- the status is never >= 500;
- a 4xx carries OpenAI's error envelope {"error": {"message", "type", "param", "code"}};
- a 4xx changed nothing in the store (tests/reliability/storecheck.py) and the provider
  was not called.

The named classes run as an explicit matrix (each one a test id, so a failure names its
route and input); a hypothesis suite then swaps random JSON into every field of a valid
body. Generation is derandomized: CI runs the same cases everywhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.live import LiveProxy, RawResponse, live_proxy, raw_request
from tests.reliability.storecheck import diff, settled_snapshot, snapshot
from tests.server.conftest import TENANT_KEY

AUTH = (b"Authorization", b"Bearer " + TENANT_KEY.encode())
JSON = (b"Content-Type", b"application/json")
SLOT = b"@@"  # where a hostile fragment goes in a route's valid body


@dataclass(frozen=True)
class Seeds:
    conversation_id: str
    item_id: str
    response_id: str


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    with live_proxy(tmp_path_factory.mktemp("hostile")) as proxy:
        yield proxy


def make_seeds(live: LiveProxy) -> Seeds:
    """A conversation with items and a stored response, fresh for each case (a DELETE that
    succeeds would otherwise leave the next cases on 404s)."""
    headers = {"Authorization": f"Bearer {TENANT_KEY}"}
    with httpx.Client(base_url=live.base_url, headers=headers, timeout=60) as client:
        items = [
            {"type": "message", "role": "user", "content": "Where is order 7?"},
            {"type": "message", "role": "assistant", "content": "Checking order 7."},
        ]
        conversation = client.post("/conversations", json={"items": items})
        conversation.raise_for_status()
        conversation_id = conversation.json()["id"]
        listed = client.get(f"/conversations/{conversation_id}/items", params={"order": "asc"})
        listed.raise_for_status()
        response = client.post("/responses", json={"model": "gpt-4o", "input": "hello"})
        response.raise_for_status()
        return Seeds(conversation_id, listed.json()["data"][0]["id"], response.json()["id"])


# --- routes -------------------------------------------------------------------------------

# (method, path template, valid body with one SLOT for a value) for every JSON route.
# {conv}, {item}, {resp} are filled from Seeds.
MESSAGE = b'{"type": "message", "role": "user", "content": @@}'
BODY_ROUTES: dict[str, tuple[str, str, bytes]] = {
    "chat": (
        "POST",
        "/v1/chat/completions",
        b'{"model": "gpt-4o", "messages": [{"role": "user", "content": @@}]}',
    ),
    "responses": ("POST", "/v1/responses", b'{"model": "gpt-4o", "input": [' + MESSAGE + b"]}"),
    "responses.conversation": (
        "POST",
        "/v1/responses",
        b'{"model": "gpt-4o", "conversation": "{conv}", "input": [' + MESSAGE + b"]}",
    ),
    "responses.input_tokens": (
        "POST",
        "/v1/responses/input_tokens",
        b'{"model": "gpt-4o", "input": [' + MESSAGE + b"]}",
    ),
    "conversations.create": ("POST", "/v1/conversations", b'{"items": [' + MESSAGE + b"]}"),
    "conversations.update": (
        "POST",
        "/v1/conversations/{conv}",
        b'{"metadata": {"topic": @@}}',
    ),
    "conversations.items.create": (
        "POST",
        "/v1/conversations/{conv}/items",
        b'{"items": [' + MESSAGE + b"]}",
    ),
    "conversations.fork": (
        "POST",
        "/threadkeeper/v1/conversations/{conv}/fork",
        b'{"item_id": "{item}", "metadata": @@}',
    ),
    "ledger.resolve": (
        "POST",
        "/threadkeeper/v1/ledger/default/some-key/resolve",
        b'{"status": "completed", "result": @@}',
    ),
}
# Routes whose body is a list of items with ids: (route, body with SLOT as the first id).
ID_ROUTES: dict[str, tuple[str, str, bytes]] = {
    "responses": (
        "POST",
        "/v1/responses",
        b'{"model": "gpt-4o", "input": [{"type": "message", "id": @@, "role": "user", '
        b'"content": [{"type": "input_text", "text": "hi"}]}]}',
    ),
    "conversations.create": (
        "POST",
        "/v1/conversations",
        b'{"items": [{"type": "message", "id": @@, "role": "user", "content": "hi"}]}',
    ),
    "conversations.items.create": (
        "POST",
        "/v1/conversations/{conv}/items",
        b'{"items": [{"type": "message", "id": @@, "role": "user", "content": "hi"}]}',
    ),
}
# Routes without a body, with the id in the path: {id} is where the hostile id goes.
PATH_ROUTES: dict[str, tuple[str, str]] = {
    "responses.retrieve": ("GET", "/v1/responses/{id}"),
    "responses.delete": ("DELETE", "/v1/responses/{id}"),
    "responses.input_items": ("GET", "/v1/responses/{id}/input_items"),
    "conversations.retrieve": ("GET", "/v1/conversations/{id}"),
    "conversations.delete": ("DELETE", "/v1/conversations/{id}"),
    "conversations.items.list": ("GET", "/v1/conversations/{id}/items"),
    "conversations.items.retrieve": ("GET", "/v1/conversations/{conv}/items/{id}"),
    "conversations.items.delete": ("DELETE", "/v1/conversations/{conv}/items/{id}"),
    "conversations.fork": ("POST", "/threadkeeper/v1/conversations/{id}/fork"),
    "ledger.get": ("GET", "/threadkeeper/v1/ledger/default/{id}"),
    "ledger.get.scope": ("GET", "/threadkeeper/v1/ledger/{id}/key"),
    "ledger.resolve": ("POST", "/threadkeeper/v1/ledger/default/{id}/resolve"),
    "ledger.list": ("GET", "/threadkeeper/v1/ledger?status={id}"),
}


def fill(template: bytes | str, seeds: Seeds) -> bytes:
    raw = template.encode() if isinstance(template, str) else template
    return (
        raw.replace(b"{conv}", seeds.conversation_id.encode())
        .replace(b"{item}", seeds.item_id.encode())
        .replace(b"{resp}", seeds.response_id.encode())
    )


# --- hostile inputs -----------------------------------------------------------------------


def nested_lists(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def nested_objects(depth: int) -> bytes:
    return b'{"a": ' * depth + b"1" + b"}" * depth


# Values put into a field of a valid body.
VALUES: dict[str, bytes] = {
    "lists-100": nested_lists(100),
    "lists-1000": nested_lists(1000),
    "lists-5000": nested_lists(5000),
    "objects-600": nested_objects(600),
    "objects-5000": nested_objects(5000),
    "int-5000-digits": b"9" * 5000,
    "float-5000-digits": b"1." + b"5" * 5000,
    "exponent-huge": b"1e999999",
    "NaN": b"NaN",
    "Infinity": b"Infinity",
    "-Infinity": b"-Infinity",
    "lone-surrogate": b'"order \\ud800 seven"',
    "lone-low-surrogate": b'"\\udfff"',
    "surrogate-key": b'{"\\ud800": "v"}',
    "nul": b'"a\\u0000b"',
    "invalid-utf8": b'"caf\xc3 \xff\xfe"',
    "overlong-utf8": b'"\xc0\xaf"',
    "huge-string": b'"' + b"a" * 900_000 + b'"',
    "huge-string-no-spaces-escapes": b'"' + b"\\u00e9" * 150_000 + b'"',
    "null": b"null",
    "int": b"5",
    "bool": b"true",
    "object": b"{}",
    "list": b"[]",
    "list-of-nulls": b"[null, null]",
    "list-of-ints": b"[1, 2]",
}
# Whole bodies.
BODIES: dict[str, bytes] = {
    "empty": b"",
    "whitespace": b"  \n",
    "null": b"null",
    "list": b"[]",
    "number": b"5",
    "string": b'"x"',
    "truncated": b'{"model": "gpt-4o", "input": [',
    "trailing-garbage": b'{"model": "gpt-4o"} x',
    "NaN": b"NaN",
    "lists-5000": nested_lists(5000),
    "objects-5000": nested_objects(5000),
    "invalid-utf8": b'{"\xff": 1}',
    "bom": b'\xef\xbb\xbf{"model": "gpt-4o"}',
    "utf16": '{"model": "gpt-4o"}'.encode("utf-16"),
    "surrogate-key-top": b'{"\\ud800": 1, "model": "gpt-4o"}',
    "duplicate-keys": b'{"model": "gpt-4o", "model": 5}',
    "int-5000-digits-top": b'{"model": "gpt-4o", "n": ' + b"9" * 5000 + b"}",
}
# Item ids.
IDS: dict[str, bytes] = {
    "lone-surrogate": b'"msg_\\ud800"',
    "nul": b'"msg_a\\u0000b"',
    "invalid-utf8": b'"msg_\xff"',
    "empty": b'""',
    "huge": b'"msg_' + b"a" * 100_000 + b'"',
    "int": b"5",
    "object": b"{}",
    "null": b"null",
}
# Ids in a path, already percent-encoded.
PATH_IDS: dict[str, str] = {
    "invalid-utf8": "%ED%A0%80",
    "invalid-utf8-ff": "%FF%FE",
    "nul": "a%00b",
    "huge": "x" * 7000,
    "dot-dot": "..%2F..%2Fhealthz",
    "space": "a%20b",
    "unicode": "%C3%A9t%C3%A9",
}


# --- checks -------------------------------------------------------------------------------


def send(
    live: LiveProxy,
    method: str,
    path: str,
    body: bytes = b"",
    headers: tuple[tuple[bytes, bytes], ...] = (AUTH, JSON),
) -> RawResponse:
    """Send one request and check the guarantees; returns the response for more checks."""
    before = settled_snapshot(live.store_path)  # an earlier answer may still be writing
    calls = len(live.provider.requests)
    response = raw_request(live.port, method, path, headers=headers, body=body)
    where = f"{method} {path[:120]} body={body[:160]!r}... -> {response.status}"
    assert response.status < 500, f"{where}: {response.body[:400]!r}"
    if 400 <= response.status < 500:
        try:
            error = json.loads(response.body)["error"]
        except (ValueError, KeyError, TypeError) as exc:
            raise AssertionError(
                f"{where}: not OpenAI's error shape: {response.body[:400]!r}"
            ) from exc
        assert set(error) == {"message", "type", "param", "code"}, f"{where}: {error}"
        assert isinstance(error["message"], str) and error["message"], where
        changed = diff(before, snapshot(live.store_path))
        assert not changed, f"{where}: a refused request changed the store: {changed}"
        called = len(live.provider.requests) - calls
        assert called == 0, f"{where}: a refused request called the provider {called} time(s)"
    return response


def value_case(live: LiveProxy, route: str, fragment: bytes) -> RawResponse:
    seeds = make_seeds(live)
    method, path, template = BODY_ROUTES[route]
    return send(
        live, method, fill(path, seeds).decode(), fill(template, seeds).replace(SLOT, fragment)
    )


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("route", list(BODY_ROUTES))
def test_hostile_value(live: LiveProxy, route: str, value: str) -> None:
    value_case(live, route, VALUES[value])


@pytest.mark.parametrize("body", list(BODIES))
@pytest.mark.parametrize("route", list(BODY_ROUTES))
def test_hostile_body(live: LiveProxy, route: str, body: str) -> None:
    seeds = make_seeds(live)
    method, path, _ = BODY_ROUTES[route]
    send(live, method, fill(path, seeds).decode(), BODIES[body])


@pytest.mark.parametrize("item_id", list(IDS))
@pytest.mark.parametrize("route", list(ID_ROUTES))
def test_hostile_item_id(live: LiveProxy, route: str, item_id: str) -> None:
    seeds = make_seeds(live)
    method, path, template = ID_ROUTES[route]
    send(
        live, method, fill(path, seeds).decode(), fill(template, seeds).replace(SLOT, IDS[item_id])
    )


def message(item_id: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "user", "content": "hi"}


DUPLICATES: dict[str, tuple[str, str, Any]] = {
    # Two items with one id in a request.
    "responses.twice": ("POST", "/v1/responses", {"model": "gpt-4o", "input": "@twice"}),
    "conversations.create.twice": ("POST", "/v1/conversations", {"items": "@twice"}),
    "conversations.items.create.twice": (
        "POST",
        "/v1/conversations/{conv}/items",
        {"items": "@twice"},
    ),
    # An id the conversation already holds.
    "responses.held": (
        "POST",
        "/v1/responses",
        {"model": "gpt-4o", "conversation": "{conv}", "input": "@held"},
    ),
    "conversations.items.create.held": (
        "POST",
        "/v1/conversations/{conv}/items",
        {"items": "@held"},
    ),
}


@pytest.mark.parametrize("case", list(DUPLICATES))
def test_duplicate_item_ids_are_refused(live: LiveProxy, case: str) -> None:
    """A duplicate item id is a 400 before anything is written or the provider is called."""
    seeds = make_seeds(live)
    method, path, template = DUPLICATES[case]
    items = {
        "@twice": [message("msg_dup"), message("msg_dup")],
        "@held": [message(seeds.item_id)],
    }
    body = {k: items.get(v, v) for k, v in with_seeds(template, seeds).items()}
    response = send(live, method, fill(path, seeds).decode(), json.dumps(body).encode())
    assert response.status == 400, response.body[:300]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("route", list(BODY_ROUTES))
def test_non_standard_json_is_refused(live: LiveProxy, route: str, value: str) -> None:
    """NaN and Infinity are not JSON: OpenAI answers 400 (the body could not be parsed),
    here as `temperature` in an otherwise valid body."""
    seeds = make_seeds(live)
    method, path, template = BODY_ROUTES[route]
    fragment = b"{}" if route == "conversations.fork" else b'"hi"'
    body = fill(template, seeds).replace(SLOT, fragment)
    body = b'{"temperature": ' + VALUES[value] + b", " + body[1:]
    assert send(live, method, fill(path, seeds).decode(), body).status == 400


@pytest.mark.parametrize("type_value", [b"{}", b"[]"])
@pytest.mark.parametrize("route", list(ID_ROUTES))
def test_unknown_field_holding_an_object_typed_by_an_object(
    live: LiveProxy, route: str, type_value: bytes
) -> None:
    """Found by the schemathesis coverage phase: `{"x": {"type": {}}}` beside an item's
    fields reached token counting with an unhashable `type`."""
    seeds = make_seeds(live)
    method, path, template = ID_ROUTES[route]
    body = fill(template, seeds).replace(SLOT, b'"msg_x", "x": {"type": ' + type_value + b"}")
    send(live, method, fill(path, seeds).decode(), body)


@pytest.mark.parametrize("path_id", list(PATH_IDS))
@pytest.mark.parametrize("route", list(PATH_ROUTES))
def test_hostile_path_id(live: LiveProxy, route: str, path_id: str) -> None:
    seeds = make_seeds(live)
    method, template = PATH_ROUTES[route]
    path = fill(template, seeds).decode().replace("{id}", PATH_IDS[path_id])
    send(live, method, path, b"{}" if method == "POST" else b"")


HEADERS: dict[str, tuple[tuple[bytes, bytes], ...]] = {
    "authorization-invalid-utf8": ((b"Authorization", b"Bearer sk-\xff\xfe\xc3"), JSON),
    "authorization-latin1": ((b"Authorization", b"Bearer sk-caf\xe9"), JSON),
    "authorization-huge": ((b"Authorization", b"Bearer sk-" + b"a" * 7000), JSON),
    "authorization-scheme-only": ((b"Authorization", b"Bearer"), JSON),
    "authorization-twice": (AUTH, (b"Authorization", b"Bearer other"), JSON),
    "thread-id-invalid-utf8": (AUTH, JSON, (b"X-Thread-Id", b"thr_\xff\xfe")),
    "thread-id-huge": (AUTH, JSON, (b"X-Thread-Id", b"thr_" + b"a" * 7000)),
    "idempotency-key-invalid-utf8": (AUTH, JSON, (b"Idempotency-Key", b"key-\xff\xfe")),
    "content-type-invalid-utf8": (AUTH, (b"Content-Type", b"application/json; charset=\xff")),
    "content-type-utf16": (AUTH, (b"Content-Type", b"application/json; charset=utf-16")),
    "utf8-header-value": (AUTH, JSON, (b"X-Note", "caf\u00e9 \u2603".encode())),
}
# Refused by aiohttp's HTTP parser before any proxy code runs: a plain-text 400, not
# OpenAI's envelope (docs/features.md, "Bad input"), but still a 4xx that writes and forwards nothing.
PARSER_REFUSED: dict[str, tuple[tuple[bytes, bytes], ...]] = {
    "huge-header": (AUTH, JSON, (b"X-Padding", b"p" * 20_000)),
    "many-headers": (AUTH, JSON, *((b"X-H%d" % i, b"v") for i in range(300))),
}


@pytest.mark.parametrize("header", list(HEADERS))
@pytest.mark.parametrize("route", ["chat", "responses", "conversations.create"])
def test_hostile_headers(live: LiveProxy, route: str, header: str) -> None:
    method, path, template = BODY_ROUTES[route]
    body = template.replace(SLOT, b'"hi"')
    send(live, method, path, body, headers=HEADERS[header])


@pytest.mark.parametrize("header", list(PARSER_REFUSED))
def test_header_blocks_the_http_parser_refuses(live: LiveProxy, header: str) -> None:
    before, calls = settled_snapshot(live.store_path), len(live.provider.requests)
    response = raw_request(
        live.port, "POST", "/v1/chat/completions", headers=PARSER_REFUSED[header], body=b"{}"
    )
    assert response.status == 400, response.body[:200]
    assert not diff(before, snapshot(live.store_path))
    assert len(live.provider.requests) == calls


# --- hypothesis: random JSON in every field of a valid body ---------------------------------

VALID_BODIES: dict[str, tuple[str, str, Any]] = {
    "chat": (
        "POST",
        "/v1/chat/completions",
        {
            "model": "gpt-4o",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "max_tokens": 10,
        },
    ),
    "responses": (
        "POST",
        "/v1/responses",
        {
            "model": "gpt-4o",
            "conversation": "{conv}",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ],
            "metadata": {"k": "v"},
            "max_output_tokens": 20,
        },
    ),
    "responses.input_tokens": (
        "POST",
        "/v1/responses/input_tokens",
        {"model": "gpt-4o", "input": [{"type": "message", "role": "user", "content": "hi"}]},
    ),
    "conversations.create": (
        "POST",
        "/v1/conversations",
        {
            "metadata": {"k": "v"},
            "items": [
                {"type": "message", "role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ],
        },
    ),
    "conversations.update": ("POST", "/v1/conversations/{conv}", {"metadata": {"k": "v"}}),
    "conversations.items.create": (
        "POST",
        "/v1/conversations/{conv}/items",
        {
            "items": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                }
            ]
        },
    ),
    "conversations.fork": (
        "POST",
        "/threadkeeper/v1/conversations/{conv}/fork",
        {"item_id": "{item}"},
    ),
    "ledger.resolve": (
        "POST",
        "/threadkeeper/v1/ledger/default/k/resolve",
        {"status": "completed", "result": "done"},
    ),
}

hostile_text = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["\ud800", "\udfff", "a\x00b", "msg_\ud800", "", " ", "\u2028"]),
)


def json_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=4) | st.dictionaries(hostile_text, children, max_size=4)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | hostile_text,
    json_containers,
    max_leaves=12,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a JSON value (the root included)."""
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += paths(child, (*prefix, index))
    return found


def replaced(value: Any, where: tuple[Any, ...], new: Any) -> Any:
    if not where:
        return new
    copy: Any = dict(value) if isinstance(value, dict) else list(value)
    copy[where[0]] = replaced(copy[where[0]], where[1:], new)
    return copy


def with_seeds(value: Any, seeds: Seeds) -> Any:
    if isinstance(value, str):
        return fill(value, seeds).decode()
    if isinstance(value, dict):
        return {k: with_seeds(v, seeds) for k, v in value.items()}
    if isinstance(value, list):
        return [with_seeds(v, seeds) for v in value]
    return value


@settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_random_json_in_every_field(live: LiveProxy, data: st.DataObject) -> None:
    route = data.draw(st.sampled_from(sorted(VALID_BODIES)), label="route")
    method, path, body = VALID_BODIES[route]
    where = data.draw(st.sampled_from(paths(body)), label="where")
    new = data.draw(json_values, label="value")
    seeds = make_seeds(live)
    hostile = replaced(with_seeds(body, seeds), where, new)
    raw = json.dumps(hostile, ensure_ascii=True).encode()  # surrogates travel as \\udXXX
    send(live, method, fill(path, seeds).decode(), raw)
