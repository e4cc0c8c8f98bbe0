"""A stored conversation's turn that fits whole is answered by turn.whole_fit, not
projected (issue 23 item 4). Through the socket: what the provider receives, the context
headers the client gets and the explain record's projection are those of the full
projection, which a second proxy is made to take for the very same turns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import proxy.server.turn as turn_module
from proxy.fake_provider import FakeProvider, Reply

from .conftest import Proxy
from .test_explain_e2e import explain, written

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You track orders. PIN: amounts in CNY."},
    {"role": "user", "content": "Check ORD-1."},
    {"type": "function_call", "call_id": "call_1", "name": "get_order", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "shipped " * 50},
    {"role": "assistant", "content": "ORD-1 shipped."},
]


def without_ids(value: Any) -> Any:
    """The provider's output ids are new on every answer: compare the rest."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k != "id"}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


async def three_turns(proxy: Proxy, provider: FakeProvider) -> list[tuple[Any, ...]]:
    """A conversation seeded with HISTORY, then three turns: for each, the input the
    provider got, the context headers and the explain record's projection."""
    client = proxy.client()
    conversation = await client.conversations.create()
    provider.script.append(Reply(text="Noted."))
    await client.responses.create(model="gpt-4o", conversation=conversation.id, input=HISTORY)
    seen = []
    for turn in range(3):
        provider.script.append(Reply(text=f"Answer {turn}."))
        raw = await client.responses.with_raw_response.create(
            model="gpt-4o", conversation=conversation.id, input=f"And ORD-{turn + 2}?"
        )
        await written(proxy)
        record = (await explain(proxy, raw.headers["x-threadkeeper-request-id"])).json()
        seen.append(
            (
                without_ids(provider.model_requests[-1].json["input"]),
                raw.headers["x-threadkeeper-context-tokens"],
                raw.headers["x-threadkeeper-trimmed"],
                record["projection"],
            )
        )
    return seen


async def test_a_fitting_turn_goes_out_as_the_full_projection_sends_it(
    make_proxy: Callable[..., Awaitable[Proxy]],
    provider: FakeProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answered: list[bool] = []
    fit = turn_module.whole_fit

    def recorded(*args: Any, **kwargs: Any) -> Any:
        found = fit(*args, **kwargs)
        answered.append(found is not None)
        return found

    monkeypatch.setattr(turn_module, "whole_fit", recorded)
    fast = await three_turns(await make_proxy(), provider)
    assert answered and all(answered)  # every request fitted: none was projected
    monkeypatch.setattr(turn_module, "whole_fit", lambda *args, **kwargs: None)
    projected = await three_turns(await make_proxy(), provider)
    assert fast == projected
    # the whole history as given: the seed and its answer, two turns, the third question
    assert len(fast[-1][0]) == len(HISTORY) + 1 + 2 * 2 + 1
