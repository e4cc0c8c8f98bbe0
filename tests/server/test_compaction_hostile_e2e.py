"""Hostile compaction input through the real socket, on SQLite and PostgreSQL: every
refusal is OpenAI's 400 naming the parameter, nothing is written or forwarded, never a
500 (issue 10, item 5)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from proxy.core.compaction import BLOB_PREFIX

from .conftest import Proxy
from .test_compaction_e2e import history
from .test_hostile_input_e2e import AUTH, assert_refused, send

USER = {"role": "user", "content": "hi"}
OPENAI_BLOB = "gAAAAABpM0Yj-2vQ0JpX3sM8c1m9q8F5y7w4bV2xZz0aKq1yYpLr3Q=="
OTHER_AUTH = {**AUTH, "Authorization": "Bearer sk-someone-else-entirely"}


@pytest.fixture
async def hostile(store_url: str, make_proxy) -> Proxy:  # type: ignore[no-untyped-def]
    return await make_proxy(store_url=store_url)


async def compacted(proxy: Proxy, headers: dict[str, str] = AUTH) -> list[dict[str, Any]]:
    body = {"model": "gpt-4o", "input": history(2)}
    response = await send(proxy, "/v1/responses/compact", body, headers=headers)
    assert response.status_code == 200, response.text
    output: list[dict[str, Any]] = response.json()["output"]
    return output


def with_blob(output: list[dict[str, Any]], blob: Any) -> list[dict[str, Any]]:
    return [*output[:-1], {**output[-1], "encrypted_content": blob}, USER]


def flipped(blob: str, at: int) -> str:
    raw = bytearray(base64.urlsafe_b64decode(blob[len(BLOB_PREFIX) :]))
    raw[at % len(raw)] ^= 0x40
    return BLOB_PREFIX + base64.urlsafe_b64encode(bytes(raw)).decode()


def short(payload: bytes) -> str:
    return BLOB_PREFIX + base64.urlsafe_b64encode(payload).decode()


BAD_BLOBS = {
    "openai's own": OPENAI_BLOB,
    "not base64": BLOB_PREFIX + "!!!not base64!!!",
    "shorter than a nonce": short(b"12345"),
    "a nonce and no tag": short(b"0" * 12),
    "empty": "",
    "prefix only": BLOB_PREFIX,
    "non-ascii": BLOB_PREFIX + "ÿÿÿÿ",
}


@pytest.mark.parametrize("blob", BAD_BLOBS.values(), ids=BAD_BLOBS.keys())
async def test_a_bad_blob_is_a_400_naming_it(hostile: Proxy, blob: str) -> None:
    output = await compacted(hostile)
    index = len(output) - 1
    body = {"model": "gpt-4o", "input": with_blob(output, blob)}
    for path in ("/v1/responses", "/v1/responses/compact", "/v1/responses/input_tokens"):
        await assert_refused(
            hostile,
            path,
            body,
            param=f"input[{index}].encrypted_content",
            code="invalid_encrypted_content",
        )


@pytest.mark.parametrize("at", [0, 11, 12, 40, -1])
async def test_a_tampered_blob_is_a_400_wherever_the_byte_is(hostile: Proxy, at: int) -> None:
    output = await compacted(hostile)
    body = {
        "model": "gpt-4o",
        "input": with_blob(output, flipped(output[-1]["encrypted_content"], at)),
    }
    await assert_refused(
        hostile,
        "/v1/responses",
        body,
        param=f"input[{len(output) - 1}].encrypted_content",
        code="invalid_encrypted_content",
    )


TRAILERS = {"four '='": "====", "one '='": "=", "a newline": "\n", "a space": " "}


@pytest.mark.parametrize("trailer", TRAILERS.values(), ids=TRAILERS.keys())
async def test_a_blob_with_trailing_garbage_is_a_400(hostile: Proxy, trailer: str) -> None:
    """Issue 20, item 9: `encrypted_content + "===="` decoded leniently to the same
    bytes and opened; only the blob exactly as the proxy wrote it opens."""
    output = await compacted(hostile)
    blob = output[-1]["encrypted_content"]
    index = len(output) - 1
    for spelled in (blob + trailer, blob.replace("-", "+").replace("_", "/") + trailer):
        body = {"model": "gpt-4o", "input": with_blob(output, spelled)}
        for path in ("/v1/responses", "/v1/responses/compact", "/v1/responses/input_tokens"):
            error = await assert_refused(
                hostile,
                path,
                body,
                param=f"input[{index}].encrypted_content",
                code="invalid_encrypted_content",
            )
            assert "base64" in error["message"]
        opened = await send(
            hostile, "/threadkeeper/v1/compactions/open", {"encrypted_content": spelled}
        )
        assert opened.status_code == 400, opened.text
        assert opened.json()["error"]["param"] == "encrypted_content"
    accepted = await send(
        hostile, "/v1/responses", {"model": "gpt-4o", "input": with_blob(output, blob)}
    )
    assert accepted.status_code == 200, accepted.text


async def test_another_tenants_blob_does_not_open(hostile: Proxy) -> None:
    theirs = await compacted(hostile, OTHER_AUTH)
    body = {"model": "gpt-4o", "input": [*theirs, USER], "store": False}
    await assert_refused(
        hostile,
        "/v1/responses",
        body,
        param=f"input[{len(theirs) - 1}].encrypted_content",
        code="invalid_encrypted_content",
    )
    opened = await send(
        hostile,
        "/threadkeeper/v1/compactions/open",
        {"encrypted_content": theirs[-1]["encrypted_content"]},
    )
    assert opened.status_code == 400
    assert opened.json()["error"]["param"] == "encrypted_content"
    # Its owner reads it.
    own = await send(
        hostile,
        "/threadkeeper/v1/compactions/open",
        {"encrypted_content": theirs[-1]["encrypted_content"]},
        headers=OTHER_AUTH,
    )
    assert own.status_code == 200, own.text
    assert own.json()["id"] == theirs[-1]["id"]


WRONG_ITEMS: list[tuple[Any, str, str]] = [
    ({"type": "compaction"}, "input[0].encrypted_content", "missing_required_parameter"),
    ({"type": "compaction", "encrypted_content": 7}, "input[0].encrypted_content", "invalid_type"),
    (
        {"type": "compaction", "encrypted_content": None},
        "input[0].encrypted_content",
        "missing_required_parameter",
    ),
    (
        {"type": "compaction", "encrypted_content": ["x"]},
        "input[0].encrypted_content",
        "invalid_type",
    ),
]


@pytest.mark.parametrize(("item", "param", "code"), WRONG_ITEMS)
async def test_a_compaction_item_of_the_wrong_shape_is_a_400(
    hostile: Proxy, item: Any, param: str, code: str
) -> None:
    for path in ("/v1/responses", "/v1/responses/compact"):
        await assert_refused(
            hostile, path, {"model": "gpt-4o", "input": [item, USER]}, param=param, code=code
        )


BAD_CONTEXT: list[tuple[Any, str, str]] = [
    ("compaction", "context_management", "invalid_type"),
    ({"type": "compaction"}, "context_management", "invalid_type"),
    ([], "context_management", "empty_array"),
    ([1], "context_management[0]", "invalid_type"),
    ([{}], "context_management[0].type", "missing_required_parameter"),
    ([{"type": 3}], "context_management[0].type", "invalid_type"),
    ([{"type": "truncation"}], "context_management[0].type", "invalid_value"),
    (
        [{"type": "compaction", "compact_threshold": 999}],
        "context_management[0].compact_threshold",
        "integer_below_min_value",
    ),
    (
        [{"type": "compaction", "compact_threshold": "2000"}],
        "context_management[0].compact_threshold",
        "invalid_type",
    ),
    (
        [{"type": "compaction", "compact_threshold": True}],
        "context_management[0].compact_threshold",
        "invalid_type",
    ),
    (
        [{"type": "compaction", "compact_threshold": 1.5e3}],
        "context_management[0].compact_threshold",
        "invalid_type",
    ),
]


@pytest.mark.parametrize(("value", "param", "code"), BAD_CONTEXT)
async def test_bad_context_management_is_a_400_naming_it(
    hostile: Proxy, value: Any, param: str, code: str
) -> None:
    body = {"model": "gpt-4o", "input": [USER], "context_management": value}
    await assert_refused(hostile, "/v1/responses", body, param=param, code=code)


BAD_COMPACT: list[tuple[dict[str, Any], str, str]] = [
    ({"input": [USER]}, "model", "missing_required_parameter"),
    ({"model": 4, "input": [USER]}, "model", "invalid_type"),
    (
        {"model": "gpt-4o", "input": [{"type": "compaction_trigger"}, USER]},
        "input[0]",
        "invalid_value",
    ),
    ({"model": "gpt-4o", "input": 5}, "input", "invalid_type"),
    ({"model": "gpt-4o", "input": [5]}, "input[0]", "invalid_type"),
    ({"model": "gpt-4o", "input": [USER], "instructions": 1}, "instructions", "invalid_type"),
    (
        {"model": "gpt-4o", "input": [USER], "prompt_cache_key": "k" * 65},
        "prompt_cache_key",
        "string_above_max_length",
    ),
    ({"model": "gpt-4o", "previous_response_id": 9}, "previous_response_id", "invalid_type"),
    (
        {"model": "gpt-4o", "previous_response_id": "resp_nope"},
        "previous_response_id",
        "previous_response_not_found",
    ),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD_COMPACT)
async def test_a_bad_compact_request_is_a_400(
    hostile: Proxy, body: dict[str, Any], param: str, code: str
) -> None:
    await assert_refused(hostile, "/v1/responses/compact", body, param=param, code=code)


async def test_a_bad_blob_on_a_stateful_thread_changes_nothing(hostile: Proxy) -> None:
    first = await send(hostile, "/v1/responses", {"model": "gpt-4o", "input": history(2)})
    assert first.status_code == 200, first.text
    output = await compacted(hostile)
    body = {
        "model": "gpt-4o",
        "previous_response_id": first.json()["id"],
        "input": with_blob(output, flipped(output[-1]["encrypted_content"], 30)),
    }
    await assert_refused(
        hostile,
        "/v1/responses",
        body,
        param=f"input[{len(output) - 1}].encrypted_content",
        code="invalid_encrypted_content",
    )


async def test_a_huge_conversation_compacts(hostile: Proxy) -> None:
    """About 900 kB of history in one compact request: answered, bounded, never a 500."""
    body = {"model": "gpt-4o", "input": history(600)}
    response = await send(hostile, "/v1/responses/compact", body)
    assert response.status_code == 200, response.text
    output = response.json()["output"]
    assert output[-1]["type"] == "compaction"
    assert len(output) == 602  # 601 user messages and the compaction
    assert len(output[-1]["encrypted_content"]) < 200_000
