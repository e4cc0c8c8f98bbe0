"""The Responses WebSocket mode (GET /v1/responses, `client.responses.connect()`) through
the proxy with the openai SDK and a fake provider, on SQLite and on PostgreSQL: the
same turn pipeline as HTTP, chaining on one socket, the socket's `store: false`
continuation, tool rounds, bad messages, limits and a client that leaves mid-response."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import openai
import pytest
import websockets
from agents import Agent, function_tool, responses_websocket_session, set_tracing_disabled
from prometheus_client.parser import text_string_to_metric_families

from proxy.clock import ManualClock
from proxy.fake_provider import Reply, response_object
from proxy.server.state import POLICIES, STORE
from proxy.server.websocket import QUEUED_PER_LANE
from proxy.store.base import Store

from .conftest import TENANT_KEY, Proxy
from .hostile import IN_USE, settled_metric

ProxyFactory = Callable[..., Awaitable[Proxy]]

TENANT = "acme"
set_tracing_disabled(True)  # the Agents SDK would otherwise export its traces to OpenAI


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL."""
    return store_url


def store_of(proxy: Proxy) -> Store:
    return proxy.app[STORE]  # type: ignore[index]


def sent_input(proxy: Proxy, index: int = -1) -> list[Any]:
    """The provider's `input` of a model request (the proxy always sends a list)."""
    body: dict[str, Any] = proxy.provider.model_requests[index].json
    return list(body["input"])


def texts(items: list[Any]) -> list[str]:
    out = []
    for item in items:
        content = item.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.append("".join(part.get("text", "") for part in content))
        else:
            out.append(str(item.get("type")))
    return out


async def events_until_done(connection: Any) -> list[Any]:
    """Every server event of one response, up to and including its terminal or error."""
    events = []
    async for event in connection:
        events.append(event)
        if event.type in ("response.completed", "response.failed", "response.incomplete"):
            return events
        if event.type == "error":
            return events
    return events


def final(events: list[Any]) -> Any:
    assert events[-1].type == "response.completed", [e.type for e in events]
    return events[-1].response


async def test_two_chained_responses_on_one_socket(proxy: Proxy) -> None:
    proxy.provider.script.extend([Reply(text="first answer"), Reply(text="second answer")])
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hello")
        events = await events_until_done(connection)
        first = final(events)
        assert events[0].type == "response.created"
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == "first answer"
        await connection.response.create(
            model="gpt-4o", input="and then?", previous_response_id=first.id
        )
        second = final(await events_until_done(connection))
    assert second.output_text == "second answer"
    assert second.previous_response_id == first.id
    # The provider got the whole chain, stateless, from the proxy's store.
    assert texts(sent_input(proxy)) == ["hello", "first answer", "and then?"]
    assert "previous_response_id" not in proxy.provider.model_requests[-1].json
    # Both are stored responses of the tenant: HTTP continues the socket's chain.
    stored = await client.responses.retrieve(second.id)
    assert stored.output_text == "second answer"
    proxy.provider.script.append(Reply(text="over http"))
    third = await client.responses.create(
        model="gpt-4o", input="last", previous_response_id=second.id
    )
    assert third.output_text == "over http"
    assert texts(sent_input(proxy)) == [
        "hello",
        "first answer",
        "and then?",
        "second answer",
        "last",
    ]
    # And on another socket.
    proxy.provider.script.append(Reply(text="on a new socket"))
    async with client.responses.connect() as connection:
        await connection.response.create(
            model="gpt-4o", input="more", previous_response_id=third.id
        )
        fourth = final(await events_until_done(connection))
    assert fourth.output_text == "on a new socket"
    assert texts(sent_input(proxy))[-3:] == ["last", "over http", "more"]


async def test_an_unstored_response_continues_on_its_socket_only(proxy: Proxy) -> None:
    """`store: false`: the socket keeps its last response for `previous_response_id`
    (OpenAI's connection-local cache); nothing is stored, and neither HTTP nor another
    socket can continue it."""
    proxy.provider.script.extend([Reply(text="one"), Reply(text="two"), Reply(text="three")])
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="alpha", store=False)
        first = final(await events_until_done(connection))
        await connection.response.create(
            model="gpt-4o", input="beta", store=False, previous_response_id=first.id
        )
        second = final(await events_until_done(connection))
        assert texts(sent_input(proxy)) == ["alpha", "one", "beta"]
        # The socket's last response continues again: the whole unstored chain is sent.
        await connection.response.create(
            model="gpt-4o", input="gamma", store=False, previous_response_id=second.id
        )
        third = final(await events_until_done(connection))
        assert third.output_text == "three"
        assert texts(sent_input(proxy)) == ["alpha", "one", "beta", "two", "gamma"]
        # Only the last one is kept: the first is gone from the socket's memory.
        await connection.response.create(
            model="gpt-4o", input="again", store=False, previous_response_id=first.id
        )
        gone = await events_until_done(connection)
    assert gone[-1].type == "error"
    assert gone[-1].status == 400 and gone[-1].error.code == "previous_response_not_found"
    assert len(proxy.provider.model_requests) == 3
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(third.id)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="gpt-4o", input="x", previous_response_id=third.id)
    async with client.responses.connect() as other:
        await other.response.create(
            model="gpt-4o", input="x", store=False, previous_response_id=third.id
        )
        refused = await events_until_done(other)
    assert refused[-1].type == "error" and refused[-1].status == 400
    assert await store_of(proxy).get_response(TENANT, third.id) is None
    assert await store_of(proxy).list_threads(TENANT, limit=10) == ()


TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]


@pytest.mark.parametrize("store", [True, False])
async def test_a_tool_call_round_on_one_socket(proxy: Proxy, store: bool) -> None:
    proxy.provider.script.extend(
        [Reply(tool_calls=[("get_weather", '{"city": "Paris"}')]), Reply(text="Sunny in Paris.")]
    )
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(
            model="gpt-4o",
            input="Weather in Paris?",
            tools=TOOLS,
            store=store,  # type: ignore[arg-type]
        )
        called = final(await events_until_done(connection))
        (call,) = [item for item in called.output if item.type == "function_call"]
        assert call.name == "get_weather"
        await connection.response.create(
            model="gpt-4o",
            tools=TOOLS,  # type: ignore[arg-type]
            store=store,
            previous_response_id=called.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
        answered = final(await events_until_done(connection))
    assert answered.output_text == "Sunny in Paris."
    sent = sent_input(proxy)
    assert [item.get("type", "message") for item in sent] == [
        "message",
        "function_call",
        "function_call_output",
    ]
    assert sent[1]["call_id"] == sent[2]["call_id"] == call.call_id


async def test_the_upgrade_is_authenticated(make_proxy: ProxyFactory) -> None:
    """A key the proxy does not know is a 401 at the upgrade: no socket, no model call."""
    strict = await make_proxy(allow_unknown=False)
    client = strict.client(api_key="sk-not-a-known-key")
    with pytest.raises(websockets.InvalidStatus) as raised:
        async with client.responses.connect():
            pass
    assert raised.value.response.status_code == 401
    assert b"invalid_api_key" in raised.value.response.body
    # No Authorization header at all (the SDK always sends one).
    url = strict.base_url.replace("http://", "ws://") + "/responses"
    with pytest.raises(websockets.InvalidStatus) as raised:
        async with websockets.connect(url):
            pass
    assert raised.value.response.status_code == 401
    assert b"You didn't provide an API key" in raised.value.response.body
    assert strict.provider.model_requests == []


async def test_bad_messages_get_error_events_and_the_socket_stays_usable(proxy: Proxy) -> None:
    proxy.provider.script.append(Reply(text="still here"))
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.send_raw("this is not json")
        (not_json,) = await events_until_done(connection)
        await connection.send_raw(json.dumps({"type": "response.cancel", "stream_id": "a"}))
        (unknown,) = await events_until_done(connection)
        await connection.send_raw(json.dumps({"model": "gpt-4o", "input": "no type"}))
        (untyped,) = await events_until_done(connection)
        await connection.send_raw(json.dumps(["response.create"]))
        (not_object,) = await events_until_done(connection)
        await connection.send_raw(json.dumps({"type": "response.create", "input": 5}))
        (bad_field,) = await events_until_done(connection)
        await connection.send_raw(
            json.dumps({"type": "response.create", "model": "gpt-4o", "background": True})
        )
        (background,) = await events_until_done(connection)
        await connection.send_raw(json.dumps({"type": "response.create", "stream_id": "a b"}))
        (bad_lane,) = await events_until_done(connection)
        await connection.response.create(model="gpt-4o", input="hello")
        served = final(await events_until_done(connection))
    assert served.output_text == "still here"
    for event in (not_json, unknown, untyped, not_object, bad_field, background, bad_lane):
        assert event.type == "error" and event.status == 400
        assert event.error.type == "invalid_request_error"
    assert "parse the JSON" in not_json.error.message
    assert unknown.error.param == "type" and "response.cancel" in unknown.error.message
    assert unknown.stream_id == "a"  # the lane the bad event named
    assert untyped.error.code == "missing_required_parameter" and untyped.error.param == "type"
    assert not_object.error.code == "invalid_type"
    assert bad_field.error.param == "input"
    assert background.error.param == "background"
    assert bad_lane.error.param == "stream_id"
    assert len(proxy.provider.model_requests) == 1
    assert len(await store_of(proxy).list_threads(TENANT, limit=10)) == 1


async def test_steering_is_refused_with_the_input_back(proxy: Proxy) -> None:
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.send_raw(
            json.dumps(
                {"type": "response.steer", "previous_response_id": "resp_1", "input": "go left"}
            )
        )
        event = await connection.recv()
    assert event.type == "response.steer.failed"
    assert event.error.code == "steering_not_supported"
    assert event.steer.input == "go left" and event.steer.previous_response_id == "resp_1"
    assert proxy.provider.model_requests == []


async def test_a_provider_error_is_an_error_event_with_its_status(proxy: Proxy) -> None:
    proxy.provider.script.extend([Reply(status=400, text="Bad model settings"), Reply(text="ok")])
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hello")
        (refused,) = await events_until_done(connection)
        await connection.response.create(model="gpt-4o", input="hello again")
        served = final(await events_until_done(connection))
    assert refused.type == "error" and refused.status == 400
    assert refused.error.message == "Bad model settings"
    assert served.output_text == "ok"


async def test_a_message_over_the_limit_closes_the_socket(make_proxy: ProxyFactory) -> None:
    """Larger than websocket_max_message_bytes: closed with 1009 before it is read
    whole; nothing reaches the provider or the store, and a new socket is served."""
    proxy = await make_proxy(settings={"websocket_max_message_bytes": 4096})
    proxy.provider.script.append(Reply(text="small is fine"))
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="x" * 8192)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await connection.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    assert proxy.provider.model_requests == []
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="x" * 1000)
        assert final(await events_until_done(connection)).output_text == "small is fine"


async def test_get_without_upgrade_is_a_405(proxy: Proxy) -> None:
    async with proxy.http() as http:
        answer = await http.get("/v1/responses", headers={"Authorization": f"Bearer {TENANT_KEY}"})
    assert answer.status_code == 405
    assert answer.json()["error"]["code"] == "method_not_allowed"


LONG = " ".join(f"w{i}" for i in range(2000))


async def test_a_client_gone_mid_response_leaves_the_thread_consistent(proxy: Proxy) -> None:
    """The socket closes while a stored response streams: the turn is cancelled as an HTTP
    client's disconnect cancels it (the row ends incomplete, no item of it is committed,
    the provider's connection is released), and an HTTP turn on the same
    previous_response_id sees the thread as it was."""
    proxy.provider.script.extend(
        [Reply(text="first answer"), Reply(text=LONG, stream_chunk_delay=0.02)]
    )
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hello")
        first = final(await events_until_done(connection))
        await connection.response.create(
            model="gpt-4o", input="tell me more", previous_response_id=first.id
        )
        created = await connection.recv()
        assert created.type == "response.created"
        while (await connection.recv()).type != "response.output_text.delta":
            pass
    cut_id = created.response.id
    store = store_of(proxy)
    status = await settled_status(store, cut_id, "incomplete")
    assert status == "incomplete"
    assert await settled_metric(proxy.base_url, IN_USE, 0) == 0
    proxy.provider.script.append(Reply(text="over http"))
    again = await client.responses.create(
        model="gpt-4o", input="tell me more", previous_response_id=first.id
    )
    assert again.output_text == "over http"
    assert texts(sent_input(proxy)) == ["hello", "first answer", "tell me more"]
    proxy.provider.script.append(Reply(text="next"))
    await client.responses.create(model="gpt-4o", input="and?", previous_response_id=again.id)
    assert texts(sent_input(proxy)) == [
        "hello",
        "first answer",
        "tell me more",
        "over http",
        "and?",
    ]


async def settled_status(store: Store, response_id: str, expected: str) -> str | None:
    """Poll the stored response's status until it is `expected` (the cancelled turn's
    cleanup runs after the socket closed); the last one seen when it never is."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while True:
        stored = await store.get_response(TENANT, response_id)
        status = stored.status if stored is not None else None
        if status == expected or loop.time() > deadline:
            return status
        await asyncio.sleep(0.05)


def create(model: str, text: str, stream_id: str | None = None) -> str:
    event: dict[str, Any] = {"type": "response.create", "model": model, "input": text}
    if stream_id is not None:
        event["stream_id"] = stream_id
    return json.dumps(event)


async def test_lanes_run_at_once_and_echo_their_stream_id(proxy: Proxy) -> None:
    held = asyncio.Event()
    proxy.provider.scripts["model-a"] = [Reply(text="from a", release=held)]
    proxy.provider.scripts["model-b"] = [Reply(text="from b")]
    client = proxy.client()
    seen: list[Any] = []
    async with client.responses.connect() as connection:
        await connection.send_raw(create("model-a", "to a", "a"))
        await connection.send_raw(create("model-b", "to b", "b"))
        # Lane b answers while lane a's provider call is still held.
        while not (seen and seen[-1].type == "response.completed"):
            seen.append(await connection.recv())
        held.set()
        seen += await events_until_done(connection)
    assert seen[0].stream_id == "b"
    done = [e for e in seen if e.type == "response.completed"]
    assert [(e.stream_id, e.response.output_text) for e in done] == [
        ("b", "from b"),
        ("a", "from a"),
    ]
    assert all(e.stream_id in ("a", "b") for e in seen)


async def test_a_lane_is_fifo_and_lanes_are_limited(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(settings={"websocket_max_concurrent_responses": 1})
    held = asyncio.Event()
    proxy.provider.script.extend([Reply(text="one", release=held), Reply(text="two")])
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.send_raw(create("gpt-4o", "first"))
        await connection.send_raw(create("gpt-4o", "second"))  # queued behind the first
        await connection.send_raw(create("gpt-4o", "elsewhere", "other"))
        refused = await connection.recv()
        for _ in range(2000):  # until the first is at the provider, held (bounded)
            if proxy.provider.model_requests:
                break
            await asyncio.sleep(0.01)
        held.set()
        # Not one event of the second (unheld) before the first's last one.
        first = final(await events_until_done(connection))
        second = final(await events_until_done(connection))
    assert refused.type == "error" and refused.stream_id == "other"
    assert refused.error.code == "websocket_stream_limit_reached"
    assert refused.error.param == "stream_id"
    assert (first.output_text, second.output_text) == ("one", "two")
    assert [texts(sent_input(proxy, i))[-1] for i in range(2)] == ["first", "second"]


async def test_an_idle_socket_is_closed_but_not_while_a_response_runs(
    make_proxy: ProxyFactory,
) -> None:
    idle = 0.2
    proxy = await make_proxy(settings={"websocket_idle_timeout": idle})
    held = asyncio.Event()
    proxy.provider.script.append(Reply(text="slow but served", release=held))
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hello")
        await asyncio.sleep(idle * 3)  # longer than the idle limit, while it runs
        held.set()
        assert final(await events_until_done(connection)).output_text == "slow but served"
        with pytest.raises(websockets.ConnectionClosedOK) as closed:
            await connection.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.reason == "idle timeout"


async def test_a_socket_past_its_lifetime_closes_after_its_running_response(
    make_proxy: ProxyFactory,
) -> None:
    """websocket_max_lifetime: the response running when it is reached finishes, a
    create sent after it gets the limit's error event, then the socket closes (1000)."""
    clock = ManualClock()
    proxy = await make_proxy(clock=clock, settings={"websocket_max_lifetime": 60})
    held = asyncio.Event()
    proxy.provider.script.extend(
        [Reply(text="served", release=held, release_after=1), Reply(text="never")]
    )
    client = proxy.client()
    async with asyncio.timeout(30), client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hello")
        assert (await connection.recv()).type == "response.created"
        clock.advance(timedelta(seconds=61))
        await connection.response.create(model="gpt-4o", input="too late")
        refused = await connection.recv()
        assert refused.type == "error"
        assert refused.error.code == "websocket_connection_limit_reached"
        held.set()
        assert final(await events_until_done(connection)).output_text == "served"
        with pytest.raises(websockets.ConnectionClosedOK) as closed:
            await connection.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.reason == "max lifetime reached"
    assert len(proxy.provider.model_requests) == 1  # the late create never reached it


LOOKUPS: list[str] = []


@function_tool
def order_status(order_id: str) -> str:
    """The status of an order."""
    LOOKUPS.append(order_id)
    return json.dumps({"order_id": order_id, "status": "shipped"})


async def test_the_agents_sdk_on_its_websocket_transport(proxy: Proxy) -> None:
    """openai-agents' `responses_websocket_session`: a tool round and a chained second
    run, every model call a `response.create` on one socket."""
    LOOKUPS.clear()
    proxy.provider.script.extend(
        [
            Reply(tool_calls=[("order_status", '{"order_id": "ORD-7"}')]),
            Reply(text="ORD-7 has shipped."),
            Reply(text="You asked about ORD-7."),
        ]
    )
    agent: Agent[Any] = Agent(
        name="support", instructions="You track orders.", model="gpt-4o", tools=[order_status]
    )
    async with responses_websocket_session(api_key=TENANT_KEY, base_url=proxy.base_url) as ws:
        first = await ws.run(agent, "Where is ORD-7?")
        second = await ws.run(
            agent, "Which order did I ask about?", previous_response_id=first.last_response_id
        )
    assert first.final_output == "ORD-7 has shipped."
    assert second.final_output == "You asked about ORD-7."
    assert LOOKUPS == ["ORD-7"]
    assert texts(sent_input(proxy))[0] == "Where is ORD-7?"
    assert texts(sent_input(proxy))[-1] == "Which order did I ask about?"
    assert await request_count(proxy, "101") == 1  # one upgrade
    assert await request_count(proxy, "200") == 3  # three turns on it


async def request_count(proxy: Proxy, status: str) -> float:
    async with proxy.http() as http:
        text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "threadkeeper_requests_total"
                and labels.get("route") == "responses.websocket"
                and labels.get("status") == status
            ):
                return float(sample.value)
    return 0.0


async def test_each_turn_is_authenticated_again(make_proxy: ProxyFactory) -> None:
    """A key removed from its policy while its socket is open: the next turn is a 401
    error event, not a model call."""
    proxy = await make_proxy(allow_unknown=False)
    proxy.provider.script.append(Reply(text="served"))
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hello")
        assert final(await events_until_done(connection)).output_text == "served"
        acme = proxy.policies_dir / "acme.yaml"
        acme.write_text(
            re.sub(r'api_keys: \["[0-9a-f]+"\]', 'api_keys: ["' + "0" * 64 + '"]', acme.read_text())
        )
        assert proxy.app[POLICIES].reload() == []  # type: ignore[index]
        await connection.response.create(model="gpt-4o", input="hello again")
        (refused,) = await events_until_done(connection)
    assert refused.type == "error" and refused.status == 401
    assert refused.error.code == "invalid_api_key"
    assert len(proxy.provider.model_requests) == 1


async def test_a_failed_turn_evicts_the_unstored_response(proxy: Proxy) -> None:
    proxy.provider.script.extend([Reply(text="one"), Reply(status=400, text="refused")])
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="alpha", store=False)
        first = final(await events_until_done(connection))
        await connection.response.create(
            model="gpt-4o", input="beta", store=False, previous_response_id=first.id
        )
        (failed,) = await events_until_done(connection)
        await connection.response.create(
            model="gpt-4o", input="beta", store=False, previous_response_id=first.id
        )
        (evicted,) = await events_until_done(connection)
    assert failed.status == 400 and failed.error.message == "refused"
    assert evicted.status == 400 and evicted.error.code == "previous_response_not_found"
    assert len(proxy.provider.model_requests) == 2


async def test_a_lane_queues_a_bounded_number_of_responses(proxy: Proxy) -> None:
    held = asyncio.Event()
    sent = QUEUED_PER_LANE + 4
    proxy.provider.script.extend(
        [Reply(text="0", release=held), *(Reply(text=str(n)) for n in range(1, sent))]
    )
    client = proxy.client()
    outcomes: list[Any] = []
    async with client.responses.connect() as connection:
        for n in range(sent):
            await connection.send_raw(create("gpt-4o", f"q{n}"))
        while len([e for e in outcomes if e.type == "error"]) < sent - QUEUED_PER_LANE - 1:
            outcomes.append(await connection.recv())
        held.set()
        while len([e for e in outcomes if e.type in ("error", "response.completed")]) < sent:
            outcomes.append(await connection.recv())
    refused = [e for e in outcomes if e.type == "error"]
    done = [e for e in outcomes if e.type == "response.completed"]
    assert {e.error.code for e in refused} == {"websocket_queue_full"}
    # One running and QUEUED_PER_LANE waiting (the first may not have left the queue yet).
    assert len(done) in (QUEUED_PER_LANE, QUEUED_PER_LANE + 1)
    assert [e.response.output_text for e in done] == [str(n) for n in range(len(done))]


async def test_a_stream_that_breaks_midway_ends_with_an_error_event(proxy: Proxy) -> None:
    proxy.provider.script.extend([Reply(text=LONG, disconnect_after=3), Reply(text="again")])
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hello")
        events = await events_until_done(connection)
        await connection.response.create(model="gpt-4o", input="hello")
        served = final(await events_until_done(connection))
    assert events[0].type == "response.created"
    broken = events[-1]
    assert broken.type == "error" and broken.status is None
    assert broken.error.code == "upstream_stream_error" and broken.error.type == "server_error"
    assert served.output_text == "again"
    stored = await store_of(proxy).get_response(TENANT, events[0].response.id)
    assert stored is not None and stored.status == "incomplete"


async def test_a_provider_that_does_not_stream_is_one_completed_event(proxy: Proxy) -> None:
    whole = response_object({"model": "gpt-4o", "input": "hi"}, Reply(text="whole"))
    proxy.provider.script.append(Reply(body=whole))
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hello", store=False)
        (done,) = await events_until_done(connection)
    assert done.type == "response.completed" and done.response.output_text == "whole"


async def test_shutdown_closes_open_sockets_and_ends_their_turns(proxy: Proxy) -> None:
    """The app's shutdown closes each socket (1001) before aiohttp waits for handlers:
    a running turn is cancelled as at a disconnect (its row ends incomplete, nothing of
    it committed)."""
    proxy.provider.script.append(Reply(text=LONG, stream_chunk_delay=0.02))
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hello")
        created = await connection.recv()
        assert created.type == "response.created"
        await proxy.app.shutdown()  # type: ignore[attr-defined]
        with pytest.raises(websockets.ConnectionClosed) as closed:
            async with asyncio.timeout(60):  # the stream alone would last about 40 s
                while True:
                    await connection.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    store = store_of(proxy)
    assert await settled_status(store, created.response.id, "incomplete") == "incomplete"
    assert await store.list_threads(TENANT, limit=10) == ()


async def test_an_unstored_chain_is_kept_up_to_the_body_limit(make_proxy: ProxyFactory) -> None:
    """The socket keeps no more of an unstored chain than HTTP would take back in one
    body (max_body_bytes): past it the client is told to send the whole input again."""
    proxy = await make_proxy(max_body_bytes=4000)
    proxy.provider.script.extend([Reply(text="one"), Reply(text="two")])
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="a" * 1500, store=False)
        first = final(await events_until_done(connection))
        # A bad continuation on another lane: refused, the default lane's kept response stays.
        bad = {"type": "response.create", "model": "gpt-4o", "input": 7, "store": False}
        bad |= {"previous_response_id": first.id, "stream_id": "x"}
        await connection.send_raw(json.dumps(bad))
        (wrong,) = await events_until_done(connection)
        await connection.response.create(
            model="gpt-4o", input="b" * 2500, store=False, previous_response_id=first.id
        )
        second = final(await events_until_done(connection))
        await connection.response.create(
            model="gpt-4o", input="c", store=False, previous_response_id=second.id
        )
        (dropped,) = await events_until_done(connection)
    assert wrong.status == 400 and wrong.error.param == "input" and wrong.stream_id == "x"
    assert texts(sent_input(proxy)) == ["a" * 1500, "one", "b" * 2500]
    assert dropped.status == 400 and dropped.error.code == "previous_response_not_found"
    assert len(proxy.provider.model_requests) == 2


async def test_the_socket_streams_the_events_http_streams(proxy: Proxy) -> None:
    """The same turn over HTTP (stream: true) and over the socket: the same events, in
    the same order, with the same sequence numbers and content."""
    proxy.provider.script.extend([Reply(text="same words here"), Reply(text="same words here")])
    client = proxy.client()
    over_http = [
        e async for e in await client.responses.create(model="gpt-4o", input="hi", stream=True)
    ]
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hi")
        over_socket = await events_until_done(connection)

    def shape(events: list[Any]) -> list[tuple[str, int, str]]:
        return [(e.type, e.sequence_number, getattr(e, "delta", "")) for e in events]

    assert shape(over_socket) == shape(over_http)
    assert over_socket[-1].response.output_text == over_http[-1].response.output_text
    assert proxy.provider.model_requests[0].json == proxy.provider.model_requests[1].json
