"""Hostile bodies, headers and URLs through the real socket (issue 8, items 3-7 and 21).

Each refused request must be a 4xx in OpenAI's shape naming the problem, with the store
unchanged (no thread, item, response, ledger or idempotency row written) and the provider
never called. Every case runs on SQLite and on PostgreSQL (set THREADKEEPER_TEST_PG_DSN),
whose TEXT columns refuse NUL.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from proxy.fake_provider import Reply
from proxy.server.state import STORE
from proxy.server.validate import MAX_JSON_DEPTH

from .conftest import TENANT_KEY, Proxy

AUTH = {"Authorization": f"Bearer {TENANT_KEY}", "Content-Type": "application/json"}
TABLES = ("threads", "items", "responses", "ledger", "idempotency")
USER = {"role": "user", "content": "hi"}
LONG_ID = "msg_" + "".join(f"{i:04x}" for i in range(2_000))  # 8 kB, hardly compressible


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


@pytest.fixture
async def hostile(store_url: str, make_proxy) -> Proxy:  # type: ignore[no-untyped-def]
    return await make_proxy(store_url=store_url)


async def row_counts(proxy: Proxy) -> dict[str, int]:
    store = proxy.app[STORE]  # type: ignore[index]
    async with store.db.read() as conn:
        return {t: int((await conn.fetchrow(f"SELECT count(*) FROM {t}"))[0]) for t in TABLES}


async def send(
    proxy: Proxy,
    path: str,
    body: bytes | Any,
    *,
    method: str = "POST",
    headers: dict[str, Any] | None = None,
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with proxy.http() as http:
        return await http.request(
            method, path, content=content if method == "POST" else None, headers=headers or AUTH
        )


async def assert_refused(
    proxy: Proxy,
    path: str,
    body: bytes | Any,
    *,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    method: str = "POST",
    headers: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The request is refused in OpenAI's shape, and nothing was written or forwarded."""
    before = await row_counts(proxy)
    calls = len(proxy.provider.requests)
    response = await send(proxy, path, body, method=method, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error
    assert error["message"]
    assert await row_counts(proxy) == before
    assert len(proxy.provider.requests) == calls
    return error


async def new_conversation(proxy: Proxy, items: list[Any] | None = None) -> str:
    response = await send(proxy, "/v1/conversations", {"items": items or [USER]})
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def nested(depth: int, leaf: bytes = b"1") -> bytes:
    """A JSON value of `depth` nested arrays around `leaf`."""
    return b"[" * depth + leaf + b"]" * depth


# --- item 3: depth and huge numbers, on every JSON route ---------------------------------

JSON_ROUTES = [
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/responses/input_tokens",
    "/v1/conversations",
    "/v1/conversations/{conv}",
    "/v1/conversations/{conv}/items",
    "/threadkeeper/v1/conversations/{conv}/fork",
    "/threadkeeper/v1/ledger/tenant/some-key/resolve",
]


@pytest.mark.parametrize("route", JSON_ROUTES)
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 5_000, 200_000], ids=["limit", "5k", "200k"])
async def test_deeply_nested_body_is_a_400_naming_the_limit(proxy, route: str, depth: int) -> None:
    path = route.format(conv=await new_conversation(proxy))
    # the body object is level 1, so `depth` arrays inside it are one level too many
    body = b'{"model": "gpt-4o", "x": ' + nested(depth) + b"}"
    error = await assert_refused(proxy, path, body, code="json_too_deep")
    assert str(MAX_JSON_DEPTH) in error["message"]


@pytest.mark.parametrize("route", JSON_ROUTES)
async def test_integer_literal_over_4300_digits_is_a_400(proxy, route: str) -> None:
    path = route.format(conv=await new_conversation(proxy))
    body = b'{"model": "gpt-4o", "x": ' + b"7" * 5_000 + b"}"
    error = await assert_refused(proxy, path, body)
    assert "4300 digits" in error["message"]


async def test_nesting_at_the_limit_is_accepted_and_stays_listable(proxy) -> None:
    """The limit counts the body as level 1: an item nested right up to it is stored, and
    listing and reading it back works (it used to break GET .../items forever)."""
    # body{1} items[2] item{3} content[4] part{5} then arrays up to the limit
    deep = json.loads(nested(MAX_JSON_DEPTH - 5))
    item = {"role": "user", "content": [{"type": "input_text", "text": "x", "extra": deep}]}
    conv = await new_conversation(proxy, [item])
    async with proxy.http() as http:
        listed = await http.get(f"/v1/conversations/{conv}/items", headers=AUTH)
    assert listed.status_code == 200, listed.text
    assert listed.json()["data"][0]["content"][0]["extra"] == deep
    await assert_refused(
        proxy,
        "/v1/conversations",
        {"items": [{**item, "content": [{**item["content"][0], "extra": [deep]}]}]},
        code="json_too_deep",
    )


async def test_a_legitimate_deep_tool_schema_passes(proxy) -> None:
    """A strict schema at OpenAI's own nesting limit (10 levels) is far below ours."""
    schema: dict[str, Any] = {"type": "string"}
    for level in range(10):
        schema = {
            "type": "object",
            "properties": {f"level{level}": {"type": "array", "items": schema}},
            "required": [f"level{level}"],
            "additionalProperties": False,
        }
    tool = {"type": "function", "name": "deep", "strict": True, "parameters": schema}
    response = await send(
        proxy, "/v1/responses", {"model": "gpt-4o", "input": "hi", "tools": [tool]}
    )
    assert response.status_code == 200, response.text
    chat_tool = {"type": "function", "function": {"name": "deep", "parameters": schema}}
    chat = {"model": "gpt-4o", "messages": [USER], "tools": [chat_tool]}
    assert (await send(proxy, "/v1/chat/completions", chat)).status_code == 200


# --- item 5: NaN and Infinity ------------------------------------------------------------


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400"])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses", "/v1/conversations"])
async def test_non_standard_numbers_are_a_400_that_the_body_could_not_be_parsed(
    proxy, route: str, token: bytes
) -> None:
    body = b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], '
    body += b'"input": "hi", "temperature": ' + token + b', "metadata": {}}'
    error = await assert_refused(proxy, route, body)
    assert error["message"].startswith("We could not parse the JSON body of your request")


# --- item 4: lone surrogates, NUL, undecodable headers -----------------------------------

SURROGATE_CASES: list[tuple[str, str, bytes, str | None]] = [
    (
        "responses content",
        "/v1/responses",
        b'{"model": "gpt-4o", "input": [{"role": "user", "content": "a\\ud800b"}]}',
        "input[0].content",
    ),
    (
        "responses part text",
        "/v1/responses",
        b'{"model": "gpt-4o", "input": [{"role": "user", "content": '
        b'[{"type": "input_text", "text": "\\udfff"}]}]}',
        "input[0].content[0].text",
    ),
    (
        "responses item id",
        "/v1/responses",
        b'{"model": "gpt-4o", "input": [{"id": "msg_\\ud800", "role": "user", "content": "x"}]}',
        "input[0].id",
    ),
    (
        "responses key",
        "/v1/responses",
        b'{"model": "gpt-4o", "input": "hi", "metadata": {"k\\ud800": "v"}}',
        "metadata",
    ),
    (
        "raw utf-8 encoded surrogate",
        "/v1/responses",
        b'{"model": "gpt-4o", "input": "a\xed\xa0\x80b"}',
        "input",
    ),
    (
        "chat content",
        "/v1/chat/completions",
        b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "\\ud83d"}]}',
        "messages[0].content",
    ),
    (
        "conversation item",
        "/v1/conversations",
        b'{"items": [{"role": "user", "content": "\\ud800"}]}',
        "items[0].content",
    ),
    (
        "conversation metadata key",
        "/v1/conversations",
        b'{"metadata": {"\\ud800": "x"}}',
        "metadata",
    ),
]


@pytest.mark.parametrize(
    ("name", "route", "body", "param"), SURROGATE_CASES, ids=[c[0] for c in SURROGATE_CASES]
)
async def test_lone_surrogates_are_a_400_naming_the_field(
    hostile, name: str, route: str, body: bytes, param: str | None
) -> None:
    await assert_refused(hostile, route, body, param=param, code="invalid_unicode")


async def test_surrogate_pairs_are_ordinary_text(hostile) -> None:
    body = b'{"model": "gpt-4o", "input": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    response = await send(hostile, "/v1/responses", body)
    assert response.status_code == 200, response.text
    assert hostile.provider.requests[-1].json["input"][0]["content"] == "\U0001f600"


async def test_lone_surrogate_in_a_conversation_turn_leaves_no_incomplete_response(
    hostile,
) -> None:
    conv = await new_conversation(hostile)
    body = {"model": "gpt-4o", "conversation": conv, "input": "ok"}
    raw = json.dumps(body).encode().replace(b'"ok"', b'"\\ud800"')
    await assert_refused(hostile, "/v1/responses", raw, param="input", code="invalid_unicode")


NUL_CASES: list[tuple[str, str, Any, str]] = [
    (
        "responses item id",
        "/v1/responses",
        {"model": "gpt-4o", "input": [{"id": "msg_a\x00b", "role": "user", "content": "x"}]},
        "input[0].id",
    ),
    (
        "responses call id",
        "/v1/responses",
        {
            "model": "gpt-4o",
            "input": [
                {"type": "function_call", "call_id": "c\x00", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c\x00", "output": "r"},
            ],
        },
        "input[0].call_id",
    ),
    (
        "previous response id",
        "/v1/responses",
        {"model": "gpt-4o", "input": "x", "previous_response_id": "resp_\x00"},
        "previous_response_id",
    ),
    (
        "conversation id",
        "/v1/responses",
        {"model": "gpt-4o", "input": "x", "conversation": {"id": "conv_\x00"}},
        "conversation.id",
    ),
    (
        "chat tool call id",
        "/v1/chat/completions",
        {
            "model": "gpt-4o",
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c\x00", "type": "function", "function": {"name": "f"}}],
                },
                {"role": "tool", "tool_call_id": "c\x00", "content": "r"},
            ],
        },
        "messages[1].tool_calls[0].id",
    ),
    (
        "chat legacy function name",
        "/v1/chat/completions",
        {
            "model": "gpt-4o",
            "messages": [USER, {"role": "function", "name": "f\x00", "content": "r"}],
        },
        "messages[1].name",
    ),
    (
        "conversation item id",
        "/v1/conversations",
        {"items": [{"id": "msg_\x00", "role": "user", "content": "x"}]},
        "items[0].id",
    ),
]


@pytest.mark.parametrize(
    ("name", "route", "body", "param"), NUL_CASES, ids=[c[0] for c in NUL_CASES]
)
async def test_nul_in_an_id_is_a_400_before_any_write(
    hostile, name: str, route: str, body: Any, param: str
) -> None:
    await assert_refused(hostile, route, body, param=param, code="invalid_value")


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/responses", {"model": "gpt-4o", "input": [{**USER, "id": LONG_ID}]}, "input[0].id"),
        ("/v1/conversations", {"items": [{**USER, "id": LONG_ID}]}, "items[0].id"),
        (
            "/v1/responses",
            {"model": "gpt-4o", "previous_response_id": LONG_ID},
            "previous_response_id",
        ),
    ],
)
async def test_an_id_too_long_for_the_store_index_is_a_400(
    hostile, route: str, body: Any, param: str
) -> None:
    """PostgreSQL refuses an index entry above ~2.7 kB: items are unique by id."""
    error = await assert_refused(hostile, route, body, param=param, code="string_above_max_length")
    assert LONG_ID not in error["message"]


async def test_nul_in_content_is_ordinary_text(hostile) -> None:
    conv = await new_conversation(hostile, [{"role": "user", "content": "a\x00b"}])
    body = {"model": "gpt-4o", "conversation": conv, "input": "c\x00d"}
    response = await send(hostile, "/v1/responses", body)
    assert response.status_code == 200, response.text
    async with hostile.http() as http:
        listed = await http.get(f"/v1/conversations/{conv}/items?order=asc", headers=AUTH)
    texts = [item["content"][0]["text"] for item in listed.json()["data"][:2]]
    assert texts == ["a\x00b", "c\x00d"]


@pytest.mark.parametrize(
    ("method", "path", "param"),
    [
        ("GET", "/v1/conversations/conv_%00", "conversation_id"),
        ("GET", "/v1/conversations/{conv}/items/msg_%00", "item_id"),
        ("GET", "/v1/conversations/{conv}/items?after=msg_%00", "after"),
        ("DELETE", "/v1/conversations/conv_%00", "conversation_id"),
        ("GET", "/v1/responses/resp_%00", "response_id"),
        ("GET", "/v1/responses/resp_%00/input_items", "response_id"),
        ("GET", "/threadkeeper/v1/ledger/tenant/k%00", "key"),
    ],
)
async def test_nul_in_a_path_or_query_id_is_a_400(
    hostile, method: str, path: str, param: str
) -> None:
    path = path.format(conv=await new_conversation(hostile))
    await assert_refused(hostile, path, b"", method=method, param=param, code="invalid_value")


@pytest.mark.parametrize("allow_unknown", [True, False])
async def test_authorization_with_invalid_utf8_is_a_401(make_proxy, allow_unknown: bool) -> None:
    proxy = await make_proxy(allow_unknown=allow_unknown)
    for token in (b"Bearer \xff\xfe", b"Bearer sk-\xed\xa0\x80", b"Bearer \xc3"):
        headers = {"Authorization": token, "Content-Type": "application/json"}
        error = await assert_refused(
            proxy,
            "/v1/responses",
            {"model": "gpt-4o", "input": "hi"},
            status=401,
            code="invalid_api_key",
            headers=headers,
        )
        assert "UTF-8" in error["message"]


async def test_thread_header_with_invalid_utf8_is_a_400(hostile) -> None:
    headers = {**AUTH, "X-Thread-Id": b"thread-\xff"}
    body = {"model": "gpt-4o", "messages": [USER]}
    await assert_refused(
        hostile,
        "/v1/chat/completions",
        body,
        param="X-Thread-Id",
        code="invalid_unicode",
        headers=headers,
    )


# --- item 6: conversation items go through the one item validator ------------------------


@pytest.mark.parametrize("route", ["/v1/conversations", "/v1/conversations/{conv}/items"])
@pytest.mark.parametrize("bad_type", ["bogus", "Message", ""])
async def test_unknown_item_type_in_a_conversation_is_a_400(
    proxy, route: str, bad_type: str
) -> None:
    path = route.format(conv=await new_conversation(proxy))
    items = [USER, {"type": bad_type, "content": "x"}]
    error = await assert_refused(
        proxy, path, {"items": items}, param="items[1].type", code="invalid_value"
    )
    assert f"'{bad_type}'" in error["message"]


async def test_every_item_type_of_the_spec_is_accepted_by_a_conversation(proxy) -> None:
    items = [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
        {"type": "reasoning", "summary": []},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
    ]
    await new_conversation(proxy, items)


# --- item 7: duplicate item ids are refused before the provider is called ---------------


async def test_duplicate_ids_inside_one_input_are_a_400(hostile) -> None:
    body = {
        "model": "gpt-4o",
        "input": [
            {"id": "msg_a", "type": "message", "role": "user", "content": "one"},
            {"id": "msg_b", "type": "message", "role": "user", "content": "two"},
            {"id": "msg_a", "type": "message", "role": "user", "content": "three"},
        ],
    }
    error = await assert_refused(
        hostile, "/v1/responses", body, param="input[2].id", code="duplicate_item"
    )
    assert "msg_a" in error["message"]


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/responses", {"store": False}),
        ("/v1/responses", {"store": False, "stream": True}),
        ("/v1/responses/compact", {}),
        ("/v1/responses/input_tokens", {}),
    ],
)
async def test_duplicate_ids_in_a_request_that_stores_nothing_are_a_400(
    hostile, path: str, extra: dict[str, Any]
) -> None:
    """Issue 20 item 18: `store: false` (and compact) never reached the thread's check, so
    the two items were forwarded and answered 200. The body alone decides, on every
    backend, before the provider is called."""
    twice = {"id": "msg_twice", "type": "message", "role": "user", "content": "again"}
    body = {"model": "gpt-4o", "input": [twice, {**USER, "id": "msg_other"}, twice], **extra}
    error = await assert_refused(hostile, path, body, param="input[2].id", code="duplicate_item")
    assert "msg_twice" in error["message"]


async def test_an_id_the_conversation_holds_is_a_400(hostile) -> None:
    conv = await new_conversation(hostile, [{**USER, "id": "msg_old"}, {**USER, "id": "msg_x"}])
    # push msg_old out of any window: it is still in the log, so still taken
    body = {
        "model": "gpt-4o",
        "conversation": conv,
        "input": [{**USER, "id": "msg_new"}, {**USER, "id": "msg_old"}],
    }
    await assert_refused(hostile, "/v1/responses", body, param="input[1].id", code="duplicate_item")
    # the items route refuses it the same way
    await assert_refused(
        hostile,
        f"/v1/conversations/{conv}/items",
        {"items": [{**USER, "id": "msg_x"}]},
        param="items[0].id",
        code="duplicate_item",
    )


async def test_an_id_the_previous_response_holds_is_a_400(hostile) -> None:
    first = await send(hostile, "/v1/responses", {"model": "gpt-4o", "input": "hi"})
    assert first.status_code == 200, first.text
    answer = first.json()
    output = answer["output"][0]
    body = {"model": "gpt-4o", "previous_response_id": answer["id"], "input": [output]}
    await assert_refused(hostile, "/v1/responses", body, param="input[0].id", code="duplicate_item")


async def test_duplicate_id_on_a_chat_thread_is_a_400(hostile) -> None:
    headers = {**AUTH, "X-Thread-Id": "thread-dup"}
    first = {"model": "gpt-4o", "messages": [{**USER, "id": "m1"}]}
    assert (await send(hostile, "/v1/chat/completions", first, headers=headers)).status_code == 200
    again = {"model": "gpt-4o", "messages": [{"role": "user", "content": "new", "id": "m1"}]}
    await assert_refused(
        hostile,
        "/v1/chat/completions",
        again,
        param="messages[0].id",
        code="duplicate_item",
        headers=headers,
    )


async def test_a_concurrent_duplicate_is_not_retried_as_a_lost_race(hostile) -> None:
    """Two turns carry the same new id and both pass the door before either commits: the
    loser's commit meets the unique key. That is no lost race: one reload after its
    VersionConflict, then the store's answer, not 64 attempts."""
    conv = await new_conversation(hostile)
    store = hostile.app[STORE]  # type: ignore[index]
    commits = 0
    original = store.commit_turn

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal commits
        commits += 1
        return await original(*args, **kwargs)

    store.commit_turn = counting
    hostile.provider.script = [Reply(text="a", delay=0.3), Reply(text="b", delay=0.3)]
    body = {"model": "gpt-4o", "conversation": conv, "input": [{**USER, "id": "msg_same"}]}
    answers = await asyncio.gather(*(send(hostile, "/v1/responses", body) for _ in range(2)))
    statuses = sorted(a.status_code for a in answers)
    assert statuses[0] == 200
    assert statuses[1] != 200
    assert commits <= 3  # winner 1; loser: VersionConflict, then the duplicate
    async with hostile.http() as http:
        listed = await http.get(f"/v1/conversations/{conv}/items", headers=AUTH)
    ids = [item["id"] for item in listed.json()["data"]]
    assert ids.count("msg_same") == 1


# --- item 21: `model` is optional on POST /v1/responses ---------------------------------


async def test_responses_without_model_are_forwarded_and_budgeted(proxy) -> None:
    body = {"prompt": {"id": "pmpt_1"}, "input": "hi"}
    response = await send(proxy, "/v1/responses", body)
    assert response.status_code == 200, response.text
    sent = proxy.provider.requests[-1].json
    assert "model" not in sent
    assert sent["prompt"] == {"id": "pmpt_1"}
    assert int(response.headers["x-threadkeeper-context-tokens"]) > 0
    # a stored chain without a model continues the same way
    body = {"previous_response_id": response.json()["id"], "input": "more"}
    again = await send(proxy, "/v1/responses", body)
    assert again.status_code == 200, again.text
    counted = await send(proxy, "/v1/responses/input_tokens", {"input": "hi"})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


async def test_responses_without_model_use_the_wildcard_limits(make_proxy) -> None:
    """The budget is the policy's "*" entry: a turn above its window is refused."""
    proxy = await make_proxy(window=5000)
    big = "word " * 10_000
    response = await send(proxy, "/v1/responses", {"input": big})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert not proxy.provider.requests


@pytest.mark.parametrize("model", [5, ""])
async def test_a_given_model_must_still_be_a_non_empty_string(proxy, model: Any) -> None:
    await assert_refused(
        proxy,
        "/v1/responses",
        {"model": model, "input": "hi"},
        param="model",
        code="invalid_type" if model == 5 else "empty_string",
    )


async def test_a_deep_provider_answer_is_kept_and_stays_listable(hostile) -> None:
    """Request bodies stop at the door's limit; an answer the provider nests 600 deep is
    still counted (no recursion) and listed back (no deep copy)."""
    conv = await new_conversation(hostile)
    deep = json.loads(nested(600))
    output = {
        "id": "msg_deep",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "ok", "annotations": [], "extra": deep}],
    }
    answer = {"id": "resp_up", "object": "response", "status": "completed", "output": [output]}
    hostile.provider.script = [Reply(body=answer)]
    body = {"model": "gpt-4o", "conversation": conv, "input": "go"}
    response = await send(hostile, "/v1/responses", body)
    assert response.status_code == 200, response.text
    async with hostile.http() as http:
        listed = await http.get(f"/v1/conversations/{conv}/items", headers=AUTH)
    assert listed.status_code == 200, listed.text
    assert listed.json()["data"][0]["content"][0]["extra"] == deep


REFUND_POLICY = """\
tools:
  refund_order:
    side_effect: true
    idempotency_key: "refund:{order_id}"
"""
REFUND_TOOL = {
    "type": "function",
    "name": "refund_order",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
}


@pytest.mark.parametrize(
    "order_id", ["A\\u0000B", "A\\ud800B", LONG_ID], ids=["nul", "surrogate", "long"]
)
async def test_a_ledger_key_the_store_cannot_keep_falls_back_to_the_hash(
    store_url: str, make_proxy, order_id: str
) -> None:
    """The model's arguments render the key; a NUL (PostgreSQL TEXT refuses it) or a lone
    surrogate (neither database binds it) makes the key the hash of the arguments."""
    proxy = await make_proxy(store_url=store_url, acme_extra=REFUND_POLICY)
    arguments = '{"order_id": "' + order_id + '"}'
    proxy.provider.script = [Reply(tool_calls=[("refund_order", arguments)])]
    body = {"model": "gpt-4o", "input": "refund it", "tools": [REFUND_TOOL]}
    response = await send(proxy, "/v1/responses", body)
    assert response.status_code == 200, response.text
    calls = [item for item in response.json()["output"] if item["type"] == "function_call"]
    assert [call["arguments"] for call in calls] == [arguments]
    async with proxy.http() as http:
        listed = await http.get("/threadkeeper/v1/ledger", headers=AUTH)
    keys = [entry["key"] for entry in listed.json()["data"]]
    assert len(keys) == 1 and keys[0].startswith("refund_order:sha256:")


async def test_a_tool_output_with_nul_completes_its_ledger_entry(
    store_url: str, make_proxy
) -> None:
    """The client's output is the entry's result: a NUL in it is ordinary text to the
    provider, and must not break the write on PostgreSQL."""
    proxy = await make_proxy(store_url=store_url, acme_extra=REFUND_POLICY)
    proxy.provider.script = [Reply(tool_calls=[("refund_order", '{"order_id": "A"}')])]
    body = {"model": "gpt-4o", "input": "refund it", "tools": [REFUND_TOOL]}
    first = await send(proxy, "/v1/responses", body)
    assert first.status_code == 200, first.text
    call = next(item for item in first.json()["output"] if item["type"] == "function_call")
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "ok\x00done"}
    body = {**body, "previous_response_id": first.json()["id"], "input": [output]}
    second = await send(proxy, "/v1/responses", body)
    assert second.status_code == 200, second.text
    assert proxy.provider.requests[-1].json["input"][-1]["output"] == "ok\x00done"
    async with proxy.http() as http:
        listed = await http.get("/threadkeeper/v1/ledger", headers=AUTH)
    [entry] = listed.json()["data"]
    assert entry["status"] == "completed"
    assert entry["result"].startswith("ok") and entry["result"].endswith("done")


@pytest.mark.parametrize("depth", [900, 200_000])
async def test_a_deep_body_with_an_idempotency_key_is_a_400(proxy, depth: int) -> None:
    """The Idempotency-Key fingerprint reads the body before the handler's door does."""
    headers = {**AUTH, "Idempotency-Key": "deep-1"}
    body = b'{"model": "gpt-4o", "input": "hi", "x": ' + nested(depth) + b"}"
    await assert_refused(proxy, "/v1/responses", body, code="json_too_deep", headers=headers)


async def test_a_request_the_provider_refuses_leaves_no_response_behind(hostile: Proxy) -> None:
    """The OpenAPI fuzz found it: a shell_call without its output goes to the provider,
    which answers 400; the response recorded in_progress before the call must go too."""
    call = {"type": "shell_call", "call_id": "call_x", "action": {"commands": ["ls"]}}
    body = {"model": "gpt-4o", "input": [USER, call]}
    before = await row_counts(hostile)
    response = await send(hostile, "/v1/responses", body)
    assert response.status_code == 400, response.text
    assert len(hostile.provider.requests) == 1  # the provider's own refusal
    assert await row_counts(hostile) == before
