"""What `x-threadkeeper-context-tokens` is, through the socket with the openai SDK, and
that docs/features.md says so (issue 20, item 14): the proxy's own count of the prompt it
sent, known before the provider answers (streams carry it too); the provider's count,
which can differ (611 against 745), is in the answer's `usage` and in the explain
record beside it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from proxy.core.items import items_from_responses_input
from proxy.core.tokens import TokenCounter
from proxy.fake_provider import FakeProvider, Reply, response_object

from .conftest import Proxy
from .test_explain_e2e import explain, written

FEATURES = Path(__file__).parent.parent.parent / "docs" / "features.md"
PROVIDER_COUNT = 745  # what the provider says it counted, not what the proxy counts


def proxys_count(sent: dict[str, Any]) -> int:
    """The proxy's tokenizer on the body the provider received."""
    items = items_from_responses_input(sent["input"]).items
    return TokenCounter.for_model(sent["model"]).responses_prompt(
        items, sent.get("instructions"), sent.get("tools") or ()
    )


async def test_the_header_is_the_proxys_count_and_the_providers_is_beside_it(
    proxy: Proxy, provider: FakeProvider
) -> None:
    body = {"model": "gpt-4o", "input": "Where is ORD-7?"}
    answer = response_object(body, Reply(text="On its way."))
    answer["usage"] = {**answer["usage"], "input_tokens": PROVIDER_COUNT}
    provider.script.append(Reply(body=answer))
    client = proxy.client()
    raw = await client.responses.with_raw_response.create(
        model="gpt-4o", input="Where is ORD-7?", instructions="Be brief.", store=False
    )
    header = int(raw.headers["x-threadkeeper-context-tokens"])
    assert header == proxys_count(provider.model_requests[-1].json) != PROVIDER_COUNT
    response = raw.parse()
    assert response.usage is not None and response.usage.input_tokens == PROVIDER_COUNT
    await written(proxy)
    record = (await explain(proxy, raw.headers["x-threadkeeper-request-id"])).json()
    assert record["estimated_input_tokens"] == header
    assert record["usage_input_tokens"] == PROVIDER_COUNT

    # A stream carries the header before the provider has counted anything.
    async with client.responses.with_streaming_response.create(
        model="gpt-4o", input="And ORD-8?", stream=True, store=False
    ) as streamed:
        assert int(streamed.headers["x-threadkeeper-context-tokens"]) == proxys_count(
            provider.model_requests[-1].json
        )
        events = [line async for line in streamed.iter_lines() if line.startswith("event:")]
    assert events[-1] == "event: response.completed"


def test_the_docs_say_whose_count_the_header_is() -> None:
    text = " ".join(FEATURES.read_text().split())
    headers = re.search(r"\*\*Headers\.\*\* (.*?)- \*\*", text)
    assert headers is not None
    said = headers.group(1)
    assert "as the provider counts" not in said
    assert "`x-threadkeeper-context-tokens` (the proxy's own count of the prompt it sent" in said
    assert "`usage_input_tokens`" in said and "`estimated_input_tokens`" in said
