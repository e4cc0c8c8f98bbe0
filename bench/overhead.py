"""Proxy overhead: direct to the provider stub vs through threadkeeper, in one run.

    python bench/overhead.py [--seconds 6] [--write]

Three processes on loopback: the scripted provider stub, the proxy (`threadkeeper serve`)
and this client (httpx). Scenarios: a 20-message chat that fits (passthrough) and a
200-item Responses request that must be trimmed, each at concurrency 1 and 32, each
bounded in time. Reports p50/p99 latency, requests/s and the proxy/direct ratios, and
with --write replaces the "## Overhead" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from results import write_section

ROOT = Path(__file__).resolve().parent.parent

POLICY = """\
tenant: default
allow_unknown_keys: true
models:
  "*": {context_window: 8000, max_output_tokens: 1000}
budget: {reserve_output_tokens: 1000, safety_margin_tokens: 200}
memory: {keep_recent_turns: 2, tool_result_max_tokens: 200}
"""

STUB = """
import asyncio, sys
from proxy.fake_provider import FakeProvider
async def main():
    provider = FakeProvider()
    await provider.start(port=int(sys.argv[1]))
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chat_body() -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for turn in range(9):
        messages += [
            {"role": "user", "content": f"Question {turn}: what is the status of order {turn}?"},
            {"role": "assistant", "content": f"Order {turn} is on its way."},
        ]
    messages.append({"role": "user", "content": "And the last one?"})
    return {"model": "gpt-4o-mini", "messages": messages}


def responses_body() -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for turn in range(40):
        items += [
            {"role": "user", "content": f"Check order ORD-{turn}."},
            {
                "type": "function_call",
                "call_id": f"call_{turn}",
                "name": "get_order",
                "arguments": json.dumps({"id": turn}),
            },
            {
                "type": "function_call_output",
                "call_id": f"call_{turn}",
                "output": json.dumps(
                    {"status": "shipped", "log": [f"scan {i}" for i in range(40)]}
                ),
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"ORD-{turn} shipped."}],
            },
            {"role": "user", "content": "thanks"},
        ]
    return {"model": "gpt-4o-mini", "input": items, "store": False}


@dataclass
class Result:
    latencies: list[float]
    seconds: float
    self_ms: list[float] = field(default_factory=list)

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) * 1000

    @property
    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds


async def drive(base: str, path: str, body: bytes, concurrency: int, seconds: float) -> Result:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": "Bearer sk-bench", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:

        async def worker() -> None:
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                response = await client.post(path, content=body, headers=headers)
                if response.status_code != 200:
                    raise SystemExit(f"{base}{path}: {response.status_code} {response.text[:200]}")
                latencies.append(time.perf_counter() - started)

        for _ in range(20):  # warm connections, caches and the token counter
            await client.post(path, content=body, headers=headers)
        begin = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Result(latencies, time.perf_counter() - begin)


def wait_ready(url: str) -> None:
    for _ in range(200):
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise SystemExit(f"{url} never came up")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=6.0, help="per scenario")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()

    stub_port, proxy_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    stub = subprocess.Popen(
        [sys.executable, "-c", STUB, str(stub_port)], env=env, stdout=subprocess.PIPE
    )
    assert stub.stdout is not None
    stub.stdout.readline()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "default.yaml").write_text(POLICY)
        log_path = Path(tmp, "proxy.log")
        log_file = log_path.open("w")
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--port",
                str(proxy_port),
                "--upstream",
                f"http://127.0.0.1:{stub_port}/v1",
                "--policies",
                tmp,
                "--store",
                f"sqlite:///{tmp}/bench.db",
            ],
            env={**env, "THREADKEEPER_LOG_LEVEL": "info", "PYTHONUNBUFFERED": "1"},
            stdout=log_file,
        )
        try:
            wait_ready(f"http://127.0.0.1:{proxy_port}/healthz")
            rows = asyncio.run(run_all(stub_port, proxy_port, args.seconds, ProxyLog(log_path)))
        finally:
            proxy.terminate()
            stub.terminate()
            proxy.wait()
            stub.wait()
    report = render(rows, args.seconds)
    print(report)
    if args.write:
        write_section("Overhead", report)


class ProxyLog:
    """The proxy's own request log: latency_ms - upstream_ms is what the proxy itself cost,
    measured inside the proxy process, free of the client's and the stub's noise."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def self_ms(self) -> list[float]:
        with self.path.open() as handle:
            handle.seek(self.offset)
            text = handle.read()
            self.offset = handle.tell()
        costs = []
        for line in text.splitlines():
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            if entry.get("event") == "request" and "upstream_ms" in entry:
                costs.append(entry["latency_ms"] - entry["upstream_ms"])
        return costs


async def run_all(
    stub_port: int, proxy_port: int, seconds: float, proxy_log: ProxyLog
) -> list[tuple[str, int, Result, Result]]:
    direct = f"http://127.0.0.1:{stub_port}"
    proxied = f"http://127.0.0.1:{proxy_port}"
    rows = []
    scenarios = [
        ("chat, 20 messages, fits (passthrough)", "/v1/chat/completions", chat_body()),
        ("responses, 200 items, trimmed to 8k", "/v1/responses", responses_body()),
    ]
    for name, path, body in scenarios:
        raw = json.dumps(body).encode()
        for concurrency in (1, 32):
            a = await drive(direct, path, raw, concurrency, seconds)
            proxy_log.self_ms()  # skip what came before this cell
            b = await drive(proxied, path, raw, concurrency, seconds)
            await asyncio.sleep(0.2)  # let the last log lines land
            b.self_ms = proxy_log.self_ms()
            rows.append((name, concurrency, a, b))
    return rows


def render(rows: list[tuple[str, int, Result, Result]], seconds: float) -> str:
    lines = [
        "## Overhead",
        "",
        f"`python bench/overhead.py --write` ({seconds:g} s per cell; stub, proxy and client are "
        "three processes on one 2-core machine, so absolute figures are noisy — read the ratios).",
        "",
        '"self p50" is the proxy\'s own time per request from its log line (latency minus the',
        "wait for the provider), measured inside the proxy process.",
        "",
        "| scenario | conc. | direct p50 ms | proxy p50 ms | added p50 ms | proxy self p50 ms | direct p99 ms | proxy p99 ms | direct req/s | proxy req/s | p50 ratio | req/s ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, concurrency, a, b in rows:
        lines.append(
            f"| {name} | {concurrency} | {a.p50:.2f} | {b.p50:.2f} | {b.p50 - a.p50:.2f} | "
            f"{statistics.median(b.self_ms) if b.self_ms else float('nan'):.2f} | "
            f"{a.p99:.2f} | {b.p99:.2f} | {a.rps:.0f} | {b.rps:.0f} | {b.p50 / a.p50:.2f} | "
            f"{b.rps / a.rps:.2f} |"
        )
    lines += [
        "",
        "Reading it: the issue's target was an added p50 under 1 ms for the passthrough at",
        'concurrency 1; it is not met. The proxy\'s own work per request ("self") is under',
        "about 2 ms for the passthrough; the rest of the added time is the extra hop. Measured",
        "alone on this VM (2026-11-29): a bare keep-alive HTTP round trip between two local",
        "processes costs about 1.3 ms (`GET /healthz`), and one `Upstream.send` to the stub",
        "(async httpx, pooled) 2.0 ms, 2.6 ms streamed, against 1.3 ms for a sync client. The",
        "trimmed Responses case pays for a projection of 200 items on every request (the",
        "client is stateless, so nothing is remembered between its requests).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
