"""What a WebSocket turn costs over an HTTP streamed turn through the proxy (issue 24, item 2).

    python bench/websocket_latency.py [--turns 200] [--write]

One process: the provider stub, the proxy (SQLite store) and one aiohttp client. The same
stored Responses turn, chained by previous_response_id (a new chain every CHAIN turns, so
both transports' threads stay the same size), two ways, interleaved turn by turn so
drift hits both alike:

- HTTP: `POST /v1/responses` with `stream: true` on a kept-alive connection;
- WebSocket: a `response.create` event on one open `GET /v1/responses` socket.

Each turn is timed from the request's send to its first event and to its
`response.completed`. The ratio WebSocket / HTTP of the medians is the figure; with
--write it replaces the "WebSocket latency" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results import write_section
from proxy.fake_provider import FakeProvider, Reply
from proxy.logs import configure_logging
from proxy.server.app import bound_port, create_app, start
from proxy.settings import Settings

CHAIN = 10  # turns per chain
WARMUP = 10  # turns per transport, not counted
POLICY = """\
tenant: default
allow_unknown_keys: true
models: {"*": {context_window: 128000, max_output_tokens: 4096}}
"""
HEADERS = {"Authorization": "Bearer sk-bench"}
ANSWER = "The parcel ships tomorrow from the Berlin warehouse, tracking number follows."


def turn_body(number: int, previous: str | None) -> dict[str, object]:
    body: dict[str, object] = {
        "model": "gpt-4o-mini",
        "input": f"Turn {number}: where is order ORD-{1000 + number}?",
    }
    if previous is not None:
        body["previous_response_id"] = previous
    return body


class Timing:
    def __init__(self) -> None:
        self.first: list[float] = []
        self.done: list[float] = []


async def http_turn(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> tuple[float, float, str]:
    started = time.perf_counter()
    first = 0.0
    response_id = ""
    async with session.post(url, json={**body, "stream": True}, headers=HEADERS) as answer:
        assert answer.status == 200, await answer.text()
        async for line in answer.content:
            if not line.startswith(b"data: "):
                continue
            if not first:
                first = time.perf_counter() - started
            event = json.loads(line[6:])
            if event["type"] == "response.completed":
                response_id = event["response"]["id"]
    return first, time.perf_counter() - started, response_id


async def socket_turn(
    ws: aiohttp.ClientWebSocketResponse, body: dict[str, object]
) -> tuple[float, float, str]:
    started = time.perf_counter()
    await ws.send_str(json.dumps({"type": "response.create", **body}))
    first = 0.0
    while True:
        message = await ws.receive()
        assert message.type == aiohttp.WSMsgType.TEXT, message
        if not first:
            first = time.perf_counter() - started
        event = json.loads(message.data)
        assert event["type"] != "error", event
        if event["type"] == "response.completed":
            return first, time.perf_counter() - started, str(event["response"]["id"])


async def run(turns: int) -> tuple[Timing, Timing]:
    provider = FakeProvider()
    await provider.start()
    http, socket = Timing(), Timing()
    with tempfile.TemporaryDirectory() as tmp:
        policies = Path(tmp)
        (policies / "default.yaml").write_text(POLICY)
        settings = Settings(
            port=0,
            policies_dir=policies,
            store_url=f"sqlite:///{policies / 'bench.db'}",
            upstream_url=provider.base_url,
            policy_reload_interval=0,
            explain=False,
        )
        app = create_app(settings, env={})
        runner = await start(settings, app)
        base = f"http://127.0.0.1:{bound_port(runner)}/v1/responses"
        try:
            connector = aiohttp.TCPConnector(limit=2)
            async with aiohttp.ClientSession(connector=connector) as session:
                ws = await session.ws_connect(base, headers=HEADERS, max_msg_size=0)
                previous: dict[str, str | None] = {"http": None, "ws": None}
                for number in range(WARMUP + turns):
                    if number % CHAIN == 0:
                        previous = {"http": None, "ws": None}
                    provider.script.extend([Reply(text=ANSWER), Reply(text=ANSWER)])
                    order = ("http", "ws") if number % 2 == 0 else ("ws", "http")
                    for kind in order:
                        body = turn_body(number, previous[kind])
                        if kind == "http":
                            first, done, previous[kind] = await http_turn(session, base, body)
                            timing = http
                        else:
                            first, done, previous[kind] = await socket_turn(ws, body)
                            timing = socket
                        if number >= WARMUP:
                            timing.first.append(first)
                            timing.done.append(done)
                await ws.close()
        finally:
            await runner.cleanup()
            await provider.stop()
    return http, socket


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.2f}"


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def report(turns: int, http: Timing, socket: Timing) -> str:
    ratio = statistics.median(socket.done) / statistics.median(http.done)
    first_ratio = statistics.median(socket.first) / statistics.median(http.first)
    added = (statistics.median(socket.done) - statistics.median(http.done)) * 1000
    return (
        "## WebSocket latency\n\n"
        "`python bench/websocket_latency.py --write` (issue 24, item 2). One process: the "
        "provider stub, the proxy on SQLite and one aiohttp client; the same stored "
        "Responses turn chained by previous_response_id (a new chain every "
        f"{CHAIN} turns), {turns} turns per transport after {WARMUP} of warm-up, "
        "interleaved: HTTP `POST /v1/responses` with `stream: true` on a kept-alive "
        "connection, and a `response.create` on one open WebSocket. Both run the one turn "
        "pipeline; the socket's frames are the same events.\n\n"
        "| | HTTP streamed (ms) | WebSocket (ms) | WebSocket / HTTP |\n"
        "|---|---:|---:|---:|\n"
        f"| to the first event, p50 | {ms(http.first)} | {ms(socket.first)} "
        f"| {first_ratio:.2f} |\n"
        f"| to `response.completed`, p50 | {ms(http.done)} | {ms(socket.done)} "
        f"| {ratio:.2f} |\n"
        f"| to `response.completed`, p90 | {p90(http.done) * 1000:.2f} "
        f"| {p90(socket.done) * 1000:.2f} | {p90(socket.done) / p90(http.done):.2f} |\n\n"
        f"A WebSocket turn takes {ratio:.2f}x an HTTP streamed turn through the proxy "
        f"({added:+.2f} ms at the median). {verdict(ratio)} The turn's own work (store, "
        "projection, the provider call) is the same on both; what differs is the HTTP "
        "request's parsing and framing against the socket's per-event decode and message.\n"
    )


def verdict(ratio: float) -> str:
    if ratio < 0.97:
        return "The socket is faster."
    if ratio > 1.03:
        return "The socket adds latency."
    return "The two are within 3% of each other."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    configure_logging("warning")
    http, socket = asyncio.run(run(args.turns))
    section = report(args.turns, http, socket)
    print(section)
    if args.write:
        write_section("WebSocket latency", section)


if __name__ == "__main__":
    main()
