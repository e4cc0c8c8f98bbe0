"""The ledger's rewriters (turn.REWRITERS: restore_ledger_calls, refuse_orphans,
answer_dangling_calls) run only for a turn whose items make or answer a call
(items.CALL_KINDS); a turn with none, under a policy that guards no tool, never enters
proxy/server/ledger.py. Through the real socket, on both APIs, with the calls the
handler's process makes recorded under `sys.setprofile`."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from proxy.fake_provider import Reply
from proxy.server import ledger

from .conftest import Proxy

LEDGER_FILE = ledger.__file__
REWRITERS = {"restore_ledger_calls", "refuse_orphans", "answer_dangling_calls"}
CALL = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "ok"}
CHAT_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    ],
}
CHAT_OUTPUT = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}


@contextmanager
def ledger_calls() -> Iterator[list[str]]:
    """The names of the functions of proxy/server/ledger.py called meanwhile on this
    thread (the proxy serves on the test's loop)."""
    names: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == LEDGER_FILE:
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        yield names
    finally:
        sys.setprofile(None)


async def test_a_responses_turn_without_a_call_never_enters_the_ledger(proxy: Proxy) -> None:
    client = proxy.client()
    first = await client.responses.create(model="gpt-4o-mini", input="Hello.")
    with ledger_calls() as names:
        await client.responses.create(
            model="gpt-4o-mini", previous_response_id=first.id, input="And then?"
        )
    assert names == []


async def test_a_responses_turn_with_a_call_goes_through_each_ledger_rewriter(
    proxy: Proxy,
) -> None:
    client = proxy.client()
    first = await client.responses.create(model="gpt-4o-mini", input="Hello.")
    with ledger_calls() as names:
        await client.responses.create(
            model="gpt-4o-mini",
            previous_response_id=first.id,
            input=[CALL, OUTPUT, {"role": "user", "content": "And then?"}],  # type: ignore[list-item]
        )
    assert REWRITERS <= set(names)
    assert "record_outputs" not in names  # no tool is guarded: nothing to record


async def test_a_stored_call_alone_still_gets_its_dangling_call_answered(
    proxy: Proxy,
) -> None:
    """The window's calls count, not only the new items': the model's call, stored
    without an output, is answered before the next turn (which holds no call) reaches
    the provider."""
    client = proxy.client()
    proxy.provider.script.append(Reply(tool_calls=[("lookup", "{}")]))
    first = await client.responses.create(model="gpt-4o-mini", input="Look it up.")
    (call_id,) = [item.call_id for item in first.output if item.type == "function_call"]
    with ledger_calls() as names:
        await client.responses.create(
            model="gpt-4o-mini", previous_response_id=first.id, input="Well?"
        )
    assert "answer_dangling_calls" in names
    sent = proxy.provider.model_requests[-1].json["input"]
    assert [i.get("type") for i in sent if i.get("call_id") == call_id] == [
        "function_call",
        "function_call_output",
    ]


async def test_a_turn_without_a_new_output_restores_and_checks_no_output(
    proxy: Proxy,
) -> None:
    """A window holding a call and its output, and a new turn with none: the restore of
    calls before outputs and the orphan check (which read the new outputs alone) are not
    entered; the window's calls still go to answer_dangling_calls."""
    client = proxy.client()
    first = await client.responses.create(
        model="gpt-4o-mini",
        input=[CALL, OUTPUT, {"role": "user", "content": "Hello."}],  # type: ignore[list-item]
    )
    with ledger_calls() as names:
        await client.responses.create(
            model="gpt-4o-mini", previous_response_id=first.id, input="And then?"
        )
    assert "answer_dangling_calls" in names
    assert not {"restore_ledger_calls", "refuse_orphans"} & set(names)


async def test_a_chat_thread_turn_is_gated_by_kind_not_type(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Chat items have no type: an assistant message's tool calls and a `tool` message
    are the "tool_calls" and "tool_output" kinds."""
    proxy = await make_proxy()
    client = proxy.client()
    thread: Any = {"extra_headers": {"X-Thread-Id": "t-gate"}}
    hello = [{"role": "user", "content": "Hello."}]
    await client.chat.completions.create(model="gpt-4o", messages=hello, **thread)
    with ledger_calls() as plain:
        await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "More."}], **thread
        )
    assert plain == []
    with ledger_calls() as names:
        await client.chat.completions.create(
            model="gpt-4o",
            messages=[CHAT_CALL, CHAT_OUTPUT, {"role": "user", "content": "Then?"}],
            **thread,
        )
    assert REWRITERS <= set(names)
