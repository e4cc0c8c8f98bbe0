"""Responses `truncation` through the real socket with the openai SDK, on SQLite and
PostgreSQL (issue 20, item 10). "disabled" is OpenAI's meaning: the history is sent
whole (nothing compressed, summarized or dropped, items an earlier cut left behind
included) or the request is OpenAI's 400 `context_length_exceeded` before the provider
is called. Absent, null or "auto": threadkeeper trims the history to fit (docs/features.md)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from proxy.core.memory import SUMMARY_MARKER

from .conftest import Proxy
from .test_hostile_input_e2e import row_counts
from .test_stateful_responses_e2e import conversation_items, texts

WINDOW = 6000
UNTRIMMED = "dropped=0, compressed=0, summarized=0"


@pytest.fixture
async def small(store_url: str, make_proxy) -> Proxy:  # type: ignore[no-untyped-def]
    return await make_proxy(store_url=store_url, window=WINDOW)


def turns(count: int, start: int = 0) -> list[dict[str, Any]]:
    """`count` closed turns of about 330 tokens each."""
    items: list[dict[str, Any]] = []
    for turn in range(start, start + count):
        note = " ".join(f"fact {turn}.{i} about the itinerary" for i in range(50))
        items.append({"role": "user", "content": f"Turn {turn}: remember {note}."})
        items.append({"role": "assistant", "content": f"Noted turn {turn}."})
    return items


def question(text: str = "What did I tell you?") -> dict[str, Any]:
    return {"role": "user", "content": text}


def assert_context_length_exceeded(exc: openai.BadRequestError) -> None:
    error = exc.body
    assert isinstance(error, dict), error
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "input"
    assert f"maximum context length is {WINDOW} tokens" in error["message"]
    assert "truncation is 'disabled'" in error["message"]


@pytest.mark.parametrize("store", [False, True])
async def test_disabled_over_the_window_is_a_400_before_the_provider(
    small: Proxy, store: bool
) -> None:
    client = small.client()
    history = [*turns(30), question()]  # about 10k tokens: over the 6000-token window
    before = await row_counts(small)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(
            model="gpt-4o", input=history, truncation="disabled", store=store
        )
    assert_context_length_exceeded(refused.value)
    assert small.provider.model_requests == []
    assert await row_counts(small) == before
    # Left out, null or "auto", the same history is trimmed to fit and answered.
    for truncation in (openai.NOT_GIVEN, None, "auto"):
        raw = await client.responses.with_raw_response.create(
            model="gpt-4o",
            input=history,
            truncation=truncation,  # type: ignore[arg-type]
            store=store,
        )
        assert raw.headers["x-threadkeeper-trimmed"] != UNTRIMMED
        assert int(raw.headers["x-threadkeeper-context-tokens"]) <= WINDOW
    assert len(small.provider.model_requests) == 3


async def test_disabled_within_the_window_is_sent_as_given(small: Proxy) -> None:
    client = small.client()
    history = [*turns(6), question()]
    raw = await client.responses.with_raw_response.create(
        model="gpt-4o", input=history, truncation="disabled", store=False
    )
    assert raw.headers["x-threadkeeper-trimmed"] == UNTRIMMED
    sent = small.provider.model_requests[-1].json
    assert sent["input"] == history
    assert sent["truncation"] == "disabled"
    assert raw.parse().truncation == "disabled"


async def test_disabled_sends_what_an_earlier_cut_left_behind(small: Proxy) -> None:
    """A conversation cut by earlier requests (a large max_output_tokens left little room)
    goes whole with "disabled" once it fits, and its cut stays for the next request."""
    client = small.client()
    conversation = await client.conversations.create()
    for turn in range(10):
        await client.responses.create(
            model="gpt-4o",
            conversation=conversation.id,
            input=turns(1, start=turn),
            max_output_tokens=3500,
        )
    cut = small.provider.model_requests[-1].json["input"]
    assert SUMMARY_MARKER in texts(cut)[0]  # the history was summarized
    held = await conversation_items(small, conversation.id)
    page = await client.conversations.items.list(conversation.id, order="asc", limit=100)
    logged = [item.model_dump(exclude_none=True) for item in page.data]
    assert len(logged) == len(held) == 30  # every turn's two inputs and its reply
    raw = await client.responses.with_raw_response.create(
        model="gpt-4o",
        conversation=conversation.id,
        input=[question()],
        max_output_tokens=16,
        truncation="disabled",
    )
    assert raw.headers["x-threadkeeper-trimmed"] == UNTRIMMED
    sent = small.provider.model_requests[-1].json["input"]
    assert not any(SUMMARY_MARKER in text for text in texts(sent))
    assert texts(sent) == [*texts(logged), question()["content"]]
    assert len(await conversation_items(small, conversation.id)) == len(held) + 2
    # The thread's cut is as it was: the next trimmed request sends the summary again.
    await client.responses.create(
        model="gpt-4o", conversation=conversation.id, input="And now?", max_output_tokens=3500
    )
    assert SUMMARY_MARKER in texts(small.provider.model_requests[-1].json["input"])[0]


async def test_disabled_on_a_stored_chain_over_the_window_changes_nothing(small: Proxy) -> None:
    client = small.client()
    conversation = await client.conversations.create()
    previous = None
    for turn in range(30):
        previous = await client.responses.create(
            model="gpt-4o", conversation=conversation.id, input=turns(1, start=turn)
        )
    assert previous is not None
    chain = await client.responses.create(model="gpt-4o", input=turns(30))
    calls = len(small.provider.model_requests)
    before = await row_counts(small)
    held = await conversation_items(small, conversation.id)
    stateful: list[dict[str, Any]] = [
        {"conversation": conversation.id},
        {"previous_response_id": previous.id},  # a branch of the conversation's chain
        {"previous_response_id": chain.id},
    ]
    for where in stateful:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model="gpt-4o",
                input=[question()],
                truncation="disabled",
                **where,
            )
        assert_context_length_exceeded(refused.value)
        for stream in (True,):
            with pytest.raises(openai.BadRequestError):
                await client.responses.create(
                    model="gpt-4o",
                    input=[question()],
                    truncation="disabled",
                    stream=stream,
                    **where,
                )
    assert len(small.provider.model_requests) == calls
    assert await row_counts(small) == before
    assert await conversation_items(small, conversation.id) == held


async def test_input_tokens_with_disabled_counts_the_whole_conversation(small: Proxy) -> None:
    client = small.client()
    conversation = await client.conversations.create()
    for turn in range(20):  # about 8,800 tokens
        await client.responses.create(
            model="gpt-4o", conversation=conversation.id, input=turns(1, start=turn)
        )
    trimmed = await client.responses.input_tokens.count(
        model="gpt-4o", conversation=conversation.id, input=[question()]
    )
    whole = await client.responses.input_tokens.count(
        model="gpt-4o", conversation=conversation.id, input=[question()], truncation="disabled"
    )
    assert trimmed.input_tokens <= WINDOW < whole.input_tokens


BAD_TRUNCATION: list[tuple[Any, str]] = [
    ("sometimes", "invalid_value"),
    ("", "invalid_value"),
    (5, "invalid_type"),
    (["auto"], "invalid_type"),
]


@pytest.mark.parametrize(("value", "code"), BAD_TRUNCATION)
async def test_a_bad_truncation_is_a_400_naming_it(small: Proxy, value: Any, code: str) -> None:
    client = small.client()
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(
            model="gpt-4o",
            input="hi",
            extra_body={"truncation": value},
        )
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == ("truncation", code)
    assert small.provider.model_requests == []


async def test_disabled_still_expands_the_clients_compaction(small: Proxy) -> None:
    """A compaction the client made is its own choice: with "disabled" it reaches the
    provider as its summary text, as without."""
    client = small.client()
    compacted = await client.responses.with_raw_response.compact(model="gpt-4o", input=turns(4))
    output = compacted.http_response.json()["output"]
    assert output[-1]["type"] == "compaction"
    answer = await client.responses.with_raw_response.create(
        model="gpt-4o", input=[*output, question()], truncation="disabled", store=False
    )
    assert answer.headers["x-threadkeeper-trimmed"] == UNTRIMMED
    sent = small.provider.model_requests[-1].json["input"]
    assert not any(item.get("type") == "compaction" for item in sent)
    assert any(SUMMARY_MARKER in text for text in texts(sent))
    assert texts(sent)[-1] == question()["content"]
