"""The side-effect ledger end to end (SPEC 6): the openai SDK is an agent that runs its
tools itself and counts every execution; the scripted provider asks for the same refund
more than once; the proxy must let it run once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from proxy.fake_provider import FakeProvider, Reply

from .conftest import TENANT_KEY, Proxy

MODEL = "gpt-4o-mini"
PG_DSN_ENV = "THREADKEEPER_TEST_PG_DSN"
REFUND = ("refund_order", '{"order_id": "ORD-1"}')
REFUND_2 = ("refund_order", '{"order_id": "ORD-2"}')


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


def tools_policy(on_duplicate: str = "replay", max_replays: int = 3) -> str:
    return f"""\
tools:
  refund_order:
    side_effect: true
    idempotency_key: "refund:{{order_id}}"
    on_duplicate: {on_duplicate}
idempotency: {{max_replays: {max_replays}}}
"""


CHAT_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "refund_order",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
]
RESPONSES_TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "refund_order",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
    }
]


class Shop:
    """The business system the client's tool touches: every refund it really runs."""

    def __init__(self, fail: bool = False) -> None:
        self.refunds: list[str] = []
        self.fail = fail

    def run(self, name: str, arguments: str) -> str:
        assert name == "refund_order"
        order = json.loads(arguments)["order_id"]
        self.refunds.append(order)
        if self.fail:
            return json.dumps({"error": "card declined"})
        return json.dumps({"refunded": order, "amount": 20})


@pytest.fixture
async def guarded(make_proxy: Callable[..., Awaitable[Proxy]]) -> Proxy:
    return await make_proxy(acme_extra=tools_policy())


# -- the two agents: Chat (stateless, full history) and Responses (previous_response_id) ----


class ChatAgent:
    def __init__(self, proxy: Proxy, shop: Shop, *, stream: bool) -> None:
        self.client = proxy.client()
        self.shop = shop
        self.stream = stream
        self.messages: list[Any] = []
        self.calls_seen: list[str] = []  # arguments of every call the client received

    async def ask(self, text: str, *, execute: bool = True) -> str | None:
        self.messages.append({"role": "user", "content": text})
        while True:
            message = await self._complete()
            self.messages.append(message)
            calls = message.get("tool_calls") or []
            self.calls_seen += [c["function"]["arguments"] for c in calls]
            if not calls or not execute:
                return message.get("content")
            for call in calls:
                output = self.shop.run(call["function"]["name"], call["function"]["arguments"])
                self.messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": output}
                )

    async def _complete(self) -> dict[str, Any]:
        args: dict[str, Any] = {"model": MODEL, "messages": self.messages, "tools": CHAT_TOOLS}
        if self.stream:
            async with self.client.chat.completions.stream(**args) as stream:
                completion = await stream.get_final_completion()
        else:
            completion = await self.client.chat.completions.create(**args)
        message = completion.choices[0].message
        return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})


class ResponsesAgent:
    def __init__(self, proxy: Proxy, shop: Shop, *, stream: bool) -> None:
        self.client = proxy.client()
        self.shop = shop
        self.stream = stream
        self.previous: str | None = None
        self.calls_seen: list[str] = []

    async def ask(self, text: str, *, execute: bool = True) -> str | None:
        given: Any = [{"role": "user", "content": text}]
        while True:
            response = await self._respond(given)
            self.previous = response.id
            calls = [item for item in response.output if item.type == "function_call"]
            self.calls_seen += [c.arguments for c in calls]
            if not calls or not execute:
                return response.output_text or None
            given = [
                {
                    "type": "function_call_output",
                    "call_id": c.call_id,
                    "output": self.shop.run(c.name, c.arguments),
                }
                for c in calls
            ]

    async def _respond(self, given: Any) -> Any:
        args: dict[str, Any] = {"model": MODEL, "input": given, "tools": RESPONSES_TOOLS}
        if self.previous is not None:
            args["previous_response_id"] = self.previous
        if self.stream:
            async with self.client.responses.stream(**args) as stream:
                return await stream.get_final_response()
        return await self.client.responses.create(**args)


Agent = ChatAgent | ResponsesAgent
AGENTS = [
    pytest.param(ChatAgent, False, id="chat"),
    pytest.param(ChatAgent, True, id="chat-stream"),
    pytest.param(ResponsesAgent, False, id="responses"),
    pytest.param(ResponsesAgent, True, id="responses-stream"),
]


def synthetic_outputs(provider: FakeProvider) -> list[dict[str, Any]]:
    """The threadkeeper outputs in the provider's last request, parsed."""
    body = provider.model_requests[-1].json
    entries = body.get("messages") or body.get("input") or []
    texts = [e.get("content") if "messages" in body else e.get("output") for e in entries]
    found = []
    for text in texts:
        if isinstance(text, str) and '"threadkeeper"' in text:
            found.append(json.loads(text))
    return found


async def ledger_entries(proxy: Proxy, status: str | None = None) -> list[dict[str, Any]]:
    query = f"?status={status}" if status else ""
    async with proxy.http() as http:
        got = await http.get(
            f"/threadkeeper/v1/ledger{query}",
            headers={"Authorization": f"Bearer {TENANT_KEY}"},
        )
    assert got.status_code == 200, got.text
    entries: list[dict[str, Any]] = got.json()["data"]
    return entries


async def unknown_outcomes(proxy: Proxy) -> float:
    async with proxy.http() as http:
        text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("threadkeeper_ledger_unknown_outcome_total{") and "refund_order" in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- scenarios ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("agent_type", "stream"), AGENTS)
async def test_refund_asked_twice_runs_once(
    guarded: Proxy, provider: FakeProvider, agent_type: type[Agent], stream: bool
) -> None:
    shop = Shop()
    agent = agent_type(guarded, shop, stream=stream)
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="Refunded ORD-1.")]
    assert await agent.ask("Refund ORD-1") == "Refunded ORD-1."
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="It was already refunded.")]

    assert await agent.ask("Refund ORD-1 again, please") == "It was already refunded."

    assert shop.refunds == ["ORD-1"]
    assert agent.calls_seen == ['{"order_id": "ORD-1"}']
    [replay] = synthetic_outputs(provider)
    assert replay["threadkeeper"] == "replay"
    assert replay["result"] == {"refunded": "ORD-1", "amount": 20}
    [entry] = await ledger_entries(guarded)
    assert (entry["key"], entry["status"], entry["scope"]) == (
        "refund:ORD-1",
        "completed",
        "tenant",
    )


@pytest.mark.parametrize(("agent_type", "stream"), AGENTS)
async def test_crashed_client_never_gets_the_call_again(
    guarded: Proxy, provider: FakeProvider, agent_type: type[Agent], stream: bool
) -> None:
    shop = Shop()
    provider.script.append(Reply(tool_calls=[REFUND]))
    crashed = agent_type(guarded, shop, stream=stream)
    await crashed.ask("Refund ORD-1", execute=False)  # got the call, then died
    assert crashed.calls_seen == ['{"order_id": "ORD-1"}']

    restarted = agent_type(guarded, shop, stream=stream)
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="I cannot confirm it yet.")]
    assert await restarted.ask("Refund ORD-1") == "I cannot confirm it yet."

    assert restarted.calls_seen == [] and shop.refunds == []
    [unknown] = synthetic_outputs(provider)
    assert unknown["threadkeeper"] == "outcome_unknown"
    assert unknown["idempotency_key"] == "refund:ORD-1"
    assert await unknown_outcomes(guarded) == 1
    [entry] = await ledger_entries(guarded, "issued")
    assert entry["key"] == "refund:ORD-1"


@pytest.mark.parametrize(("agent_type", "stream"), AGENTS)
async def test_parallel_calls_hand_out_only_the_new_one(
    guarded: Proxy, provider: FakeProvider, agent_type: type[Agent], stream: bool
) -> None:
    shop = Shop()
    agent = agent_type(guarded, shop, stream=stream)
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="Refunded ORD-1.")]
    await agent.ask("Refund ORD-1")
    provider.script += [Reply(tool_calls=[REFUND, REFUND_2]), Reply(text="Both are refunded.")]

    assert await agent.ask("Refund ORD-1 and ORD-2") == "Both are refunded."

    assert shop.refunds == ["ORD-1", "ORD-2"]
    assert agent.calls_seen == ['{"order_id": "ORD-1"}', '{"order_id": "ORD-2"}']
    statuses = {e["key"]: e["status"] for e in await ledger_entries(guarded)}
    assert statuses == {"refund:ORD-1": "completed", "refund:ORD-2": "completed"}
    if agent_type is ResponsesAgent:
        # The stored thread kept the withheld duplicate and its replayed output, so the
        # model sees the whole trajectory on the next turn.
        [replay] = synthetic_outputs(provider)
        assert replay["threadkeeper"] == "replay"


@pytest.mark.parametrize(("agent_type", "stream"), AGENTS[::3])
async def test_on_duplicate_block(
    make_proxy: Callable[..., Awaitable[Proxy]],
    provider: FakeProvider,
    agent_type: type[Agent],
    stream: bool,
) -> None:
    proxy = await make_proxy(acme_extra=tools_policy(on_duplicate="block"))
    shop = Shop()
    agent = agent_type(proxy, shop, stream=stream)
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="Refunded.")]
    await agent.ask("Refund ORD-1")
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="That was done before.")]

    assert await agent.ask("Refund ORD-1 again") == "That was done before."

    assert shop.refunds == ["ORD-1"]
    [blocked] = synthetic_outputs(provider)
    assert blocked["threadkeeper"] == "blocked" and "result" not in blocked


@pytest.mark.parametrize(("agent_type", "stream"), AGENTS)
async def test_max_replays_bounds_the_loop(
    make_proxy: Callable[..., Awaitable[Proxy]],
    provider: FakeProvider,
    agent_type: type[Agent],
    stream: bool,
) -> None:
    proxy = await make_proxy(acme_extra=tools_policy(max_replays=1))
    shop = Shop()
    agent = agent_type(proxy, shop, stream=stream)
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="Refunded.")]
    await agent.ask("Refund ORD-1")
    before = len(provider.model_requests)
    provider.script += [Reply(tool_calls=[REFUND]) for _ in range(3)]

    assert await agent.ask("Refund ORD-1 again") is None

    assert len(provider.model_requests) - before == 2  # the answer, then one replay round
    assert shop.refunds == ["ORD-1"] and len(agent.calls_seen) == 1
    provider.script.clear()


async def test_failed_refund_may_run_again(guarded: Proxy, provider: FakeProvider) -> None:
    shop = Shop(fail=True)
    agent = ChatAgent(guarded, shop, stream=False)
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="The card was declined.")]
    await agent.ask("Refund ORD-1")
    shop.fail = False
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="Refunded now.")]

    assert await agent.ask("Try again") == "Refunded now."

    assert shop.refunds == ["ORD-1", "ORD-1"]
    [entry] = await ledger_entries(guarded)
    assert (entry["status"], entry["attempts"]) == ("completed", 2)
    assert json.loads(entry["result"]) == {"refunded": "ORD-1", "amount": 20}


async def test_second_output_for_a_call_is_ignored(guarded: Proxy, provider: FakeProvider) -> None:
    client = guarded.client()
    provider.script.append(Reply(tool_calls=[REFUND]))
    messages: list[Any] = [{"role": "user", "content": "Refund ORD-1"}]
    first = await client.chat.completions.create(model=MODEL, messages=messages)
    message = first.choices[0].message
    assert message.tool_calls is not None
    call_id = message.tool_calls[0].id
    messages.append(message.model_dump(exclude_none=True, include={"role", "tool_calls"}))
    for output in ('{"refunded": "ORD-1"}', '{"error": "late duplicate"}'):
        tool = {"role": "tool", "tool_call_id": call_id, "content": output}
        await client.chat.completions.create(model=MODEL, messages=[*messages, tool])

    [entry] = await ledger_entries(guarded)
    assert (entry["status"], entry["result"]) == ("completed", '{"refunded": "ORD-1"}')


async def test_output_of_a_cut_off_turn_restores_its_call(
    guarded: Proxy, provider: FakeProvider
) -> None:
    """The call went out in a stream the client dropped before its end: the turn was not
    kept, yet the ledger knows the call, so its output is accepted on the conversation."""
    client = guarded.client()
    conversation = await client.conversations.create()
    lookup = ("lookup_order", '{"order_id": "ORD-1"}')  # keeps the stream going after the call
    provider.script.append(Reply(tool_calls=[REFUND, lookup], stream_chunk_delay=0.05))
    call_id = response_id = None
    async with client.responses.stream(
        model=MODEL, input="Refund ORD-1", conversation=conversation.id, tools=RESPONSES_TOOLS
    ) as stream:
        async for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_item.done" and event.item.type == "function_call":
                call_id = event.item.call_id
                break
    assert call_id is not None and response_id is not None
    assert await settled_status(client, response_id) == "incomplete"
    provider.script.append(Reply(text="Refund noted."))

    answer = await client.responses.create(
        model=MODEL,
        conversation=conversation.id,
        input=[{"type": "function_call_output", "call_id": call_id, "output": '{"ok": true}'}],
    )

    assert answer.output_text == "Refund noted."
    sent = provider.model_requests[-1].json["input"]
    restored = [i for i in sent if i.get("type") == "function_call"]
    assert [(i["call_id"], i["name"]) for i in restored] == [(call_id, "refund_order")]
    [entry] = await ledger_entries(guarded)
    assert entry["status"] == "completed"


async def settled_status(client: openai.AsyncOpenAI, response_id: str) -> str:
    """The response's status once the proxy has noticed the client left."""
    for _ in range(100):
        status = (await client.responses.retrieve(response_id)).status
        if status != "in_progress":
            return str(status)
        await asyncio.sleep(0.05)
    return "in_progress"


async def test_unknown_call_output_is_still_a_400(guarded: Proxy, provider: FakeProvider) -> None:
    client = guarded.client()
    conversation = await client.conversations.create()
    with pytest.raises(openai.BadRequestError, match="No tool call found"):
        await client.responses.create(
            model=MODEL,
            conversation=conversation.id,
            input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
        )


# -- two replicas on one store ---------------------------------------------------------------------


@pytest.fixture
async def replicas(make_proxy: Callable[..., Awaitable[Proxy]]) -> list[Proxy]:
    """Two app instances on one store (a PostgreSQL schema, or a SQLite file as `serve
    --workers 2` shares), as replicas behind a load balancer."""
    return [await make_proxy(acme_extra=tools_policy()) for _ in range(2)]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_two_replicas_racing_hand_out_one_refund(
    replicas: list[Proxy], provider: FakeProvider, stream: bool
) -> None:
    # Both replicas get the same refund at the same time; the loser's turn continues.
    provider.script += [
        Reply(tool_calls=[REFUND], delay=0.2),
        Reply(tool_calls=[REFUND], delay=0.2),
        Reply(text="Another request is handling that refund."),
    ]
    shop = Shop()
    agents = [ChatAgent(proxy, shop, stream=stream) for proxy in replicas]

    await asyncio.gather(*(agent.ask("Refund ORD-1", execute=False) for agent in agents))

    assert sorted(len(agent.calls_seen) for agent in agents) == [0, 1]
    entries = await ledger_entries(replicas[0])
    assert [(e["key"], e["status"]) for e in entries] == [("refund:ORD-1", "issued")]


async def test_several_choices_are_refused_when_tools_have_side_effects(
    guarded: Proxy, provider: FakeProvider
) -> None:
    # Only one choice can pass the ledger: n > 1 would hand out unguarded refunds.
    client = guarded.client()
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "refund"}], n=2
        )
    assert info.value.body["param"] == "n"  # type: ignore[index]
    assert not provider.requests
