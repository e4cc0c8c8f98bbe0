"""Proxy overhead: direct to the provider stub, through a bare aiohttp relay, through
threadkeeper (and LiteLLM), one run.

    python bench/overhead.py [--seconds 3] [--write] [--title T] [--profile-only]
                             [--litellm-python PATH] [--postgres DSN] [--chat-only]
                             [--profile CASE,...] [--exact-stub]

Every figure of issue 23's "Measurement" section, from one run on loopback, as ratios to
the bare relay (bench/bare_relay.py: the floor any Python hop pays). The provider stub
(`proxy.fake_provider.FakeProvider`), the bare relay, each proxy (`python -m proxy serve`,
and LiteLLM's proxy when `litellm[proxy]` imports) and this client run as separate
processes; the client is an `aiohttp.ClientSession` with one pooled connection per
concurrent client, so the direct figure is the stub's, not the client's. Cells, the
stateless ones in interleaved rounds so load drift hits every target alike:

- chat passthrough: 20 messages that fit, no thread; 1 client (p50) and 32 clients
  (requests/s), through `serve` with 1 worker and, when the build has `--workers`, 2;
- a Responses turn on a stored conversation of 200 prior items (`POST /v1/responses`
  with `conversation`, one new user message; each conversation is seeded through the
  proxy and takes at most TURNS_PER_CONVERSATION turns, so it stays at 200-220 items)
  against a direct stateless request of the same 200 items; LiteLLM gets the stateless
  request too (it keeps no conversations);
- streamed chat: time to the first body bytes (the first SSE event);
- with `--postgres DSN`, the Responses cells also through threadkeeper on PostgreSQL
  with 1 and 2 workers (on a schema of its own, dropped after the run): what `--workers`
  gives stateful turns when the store is not one SQLite file;
- the proxy's resident memory (VmRSS of it and its child processes) after the run;
- profiles, each in a fresh proxy under pyinstrument (`--profile`, PROFILED: by default
  the passthrough hammered by 8 clients for a few seconds, and warm turns on 200-item
  conversations seeded by another proxy on the same database; also the passthrough at 1
  and 32 clients and the streamed chat at 1 client); the heaviest frames of the call tree
  and of self time.

`--chat-only` measures the chat cells alone (the passthrough and the streamed chat).
The stub is `FakeProvider(light=True)`: no record, no dangling-call check, and the same
usage counted once per message or item (a conversation's history sent again is a lookup
an item), so the cores go to the proxies, not to the stub (the exact stub spent about as
much CPU on a 200-item turn as the proxy); `--exact-stub` gives the tests' stub.

LiteLLM is looked for in this interpreter, then in `.venv-litellm/` at the repo root
(`python -m venv .venv-litellm && .venv-litellm/bin/pip install 'litellm[proxy]'`),
or where `--litellm-python` points; without it its column says why. --write replaces
the "## Overhead" section of bench/RESULTS.md (`--title`: another section).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import aiohttp
from results import write_section

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gpt-4o-mini"
HEADERS = {"Authorization": "Bearer sk-bench", "Content-Type": "application/json"}
WARMUP = 20
ROUNDS = 3  # each stateless cell is measured in this many turns, the targets interleaved
PRIOR_ITEMS = 200
TURNS_PER_CONVERSATION = 10
SINGLE_CONVERSATIONS = 10  # 1 client: up to 100 turns
CONVERSATIONS_PER_CLIENT = 2  # 32 clients: up to 640 turns
MANY = 32
PROFILE_CLIENTS = 8
PROFILE_LINES = 15
# Few conversations, many turns each: the first turn of each, on a proxy that never read
# it, loads the whole window; the rest are the turns the measurement times.
PROFILE_CONVERSATIONS = 4
PROFILE_TURNS = 50

# A window the 200-item conversation fits in: the cell measures the turn, not a trim.
POLICY = """\
tenant: default
allow_unknown_keys: true
models:
  "*": {context_window: 128000, max_output_tokens: 1000}
budget: {reserve_output_tokens: 1000, safety_margin_tokens: 200}
memory: {keep_recent_turns: 2, tool_result_max_tokens: 200}
"""

# The exact stub records every request; clearing the record keeps its memory flat.
STUB = """
import asyncio, sys
from proxy.fake_provider import FakeProvider
async def main():
    provider = FakeProvider(light=sys.argv[2] == "light")
    await provider.start(port=int(sys.argv[1]))
    print("ready", flush=True)
    while True:
        await asyncio.sleep(1)
        provider.requests.clear()
asyncio.run(main())
"""

LITELLM_CONFIG = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: http://127.0.0.1:{stub_port}/v1
      api_key: sk-bench
litellm_settings:
  telemetry: false
  set_verbose: false
"""

TARGETS = {
    "chat_1": "chat passthrough, 20 messages, 1 client: added p50",
    "chat_32": "chat passthrough, 32 clients: requests/s (share of direct)",
    "responses_1": "Responses turn, 200-item conversation, 1 client: added p50",
    "responses_32": "Responses turn, 200-item conversation, 32 clients: requests/s",
    "ttfb": "streamed chat, 1 client: time to first byte added",
    "rss": "proxy resident memory after the run",
}


# --- request bodies -------------------------------------------------------------------------


def chat_body(*, stream: bool = False) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for turn in range(9):
        messages += [
            {"role": "user", "content": f"Question {turn}: what is the status of order {turn}?"},
            {"role": "assistant", "content": f"Order {turn} is on its way."},
        ]
    messages.append({"role": "user", "content": "And the last one?"})
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    if stream:
        body["stream"] = True
    return body


def history_items(count: int) -> list[dict[str, Any]]:
    """An agent's history: question, tool call, tool result, answer, thanks (5 per turn)."""
    items: list[dict[str, Any]] = []
    for turn in range((count + 4) // 5):
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
    return items[:count]


NEXT_QUESTION = {"role": "user", "content": "And the next order?"}


def stateless_responses_body() -> dict[str, Any]:
    """What a client without stored state sends for the same turn: all 200 items again."""
    return {"model": MODEL, "input": [*history_items(PRIOR_ITEMS), NEXT_QUESTION], "store": False}


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


# --- measuring ------------------------------------------------------------------------------


@dataclass
class Cell:
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.latencies)

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


def skipped(note: str) -> Cell:
    return Cell(note=note)


Request = Callable[[aiohttp.ClientSession], Awaitable[float | None]]


def post(url: str, body: bytes) -> Request:
    """A full request: status, headers and the whole body."""

    async def send(session: aiohttp.ClientSession) -> float:
        started = time.perf_counter()
        async with session.post(url, data=body, headers=HEADERS) as response:
            payload = await response.read()
            if response.status != 200:
                raise SystemExit(f"{url}: {response.status} {payload[:300]!r}")
        return time.perf_counter() - started

    return send


def first_byte(url: str, body: bytes) -> Request:
    """A streamed request timed to its first body bytes; the rest is read untimed."""

    async def send(session: aiohttp.ClientSession) -> float:
        started = time.perf_counter()
        async with session.post(url, data=body, headers=HEADERS) as response:
            if response.status != 200:
                raise SystemExit(f"{url}: {response.status} {(await response.read())[:300]!r}")
            await response.content.readany()
            elapsed = time.perf_counter() - started
            await response.read()
        return elapsed

    return send


def session(concurrency: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120))


async def timed(request: Request, concurrency: int, seconds: float) -> Cell:
    """`concurrency` clients repeat `request` until `seconds` have passed."""
    async with session(concurrency) as http:
        for _ in range(WARMUP):
            await request(http)
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            while time.perf_counter() < deadline:
                latency = await request(http)
                assert latency is not None
                latencies.append(latency)

        begin = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return Cell(latencies, time.perf_counter() - begin)


async def in_rounds(
    requests: dict[str, Request], concurrency: int, seconds: float, rounds: int = ROUNDS
) -> dict[str, Cell]:
    """Each target `seconds` in all, in `rounds` turns taken one after the other, so that a
    change of the machine's load falls on every target alike (the ratios are the result)."""
    cells = {name: Cell() for name in requests}
    for _ in range(rounds):
        for name, request in requests.items():
            part = await timed(request, concurrency, seconds / rounds)
            cells[name].latencies += part.latencies
            cells[name].seconds += part.seconds
    return cells


async def alternating(requests: dict[str, Request | None], seconds: float) -> dict[str, Cell]:
    """One client sending each target a request in turn, for `seconds` per target: on a
    shared machine every target then meets the same load (a ratio of two p50s measured
    minutes apart would not). A Request that returns None is used up and left out."""
    cells = {name: Cell() for name in requests}
    live = {name: request for name, request in requests.items() if request is not None}
    async with session(1) as http:
        for request in live.values():
            for _ in range(WARMUP // 4):
                await request(http)
        deadline = time.perf_counter() + seconds * len(live)
        while live and time.perf_counter() < deadline:
            for name, request in list(live.items()):
                started = time.perf_counter()
                latency = await request(http)
                if latency is None:
                    del live[name]
                    continue
                cells[name].latencies.append(latency)
                cells[name].seconds += time.perf_counter() - started
    return cells


def turns_of(base: str, conversations: Sequence[str], turns: int) -> Request:
    """The next turn of `conversations`, `turns` each in order; None once they are used."""
    bodies = iter([turn_body(c) for c in conversations for _ in range(turns)])

    async def send(http: aiohttp.ClientSession) -> float | None:
        body = next(bodies, None)
        return None if body is None else await post(f"{base}/v1/responses", body)(http)

    return send


async def conversation_turns(
    base: str,
    conversations: Sequence[str],
    concurrency: int,
    seconds: float,
    turns: int = TURNS_PER_CONVERSATION,
) -> Cell:
    """Each client takes its own conversations, `turns` turns each, until they are used up
    or `seconds` have passed."""
    async with session(concurrency) as http:
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def client(mine: Sequence[str]) -> None:
            for conversation in mine:
                turn = post(f"{base}/v1/responses", turn_body(conversation))
                for _ in range(turns):
                    if time.perf_counter() >= deadline:
                        return
                    latency = await turn(http)
                    assert latency is not None
                    latencies.append(latency)

        begin = time.perf_counter()
        await asyncio.gather(*(client(conversations[i::concurrency]) for i in range(concurrency)))
        return Cell(latencies, time.perf_counter() - begin)


def turn_body(conversation: str) -> bytes:
    return encode({"model": MODEL, "conversation": conversation, "input": [NEXT_QUESTION]})


async def seed_conversations(base: str, count: int) -> list[str]:
    """Conversations of exactly PRIOR_ITEMS items, made through the proxy's own API: an
    empty conversation, then one turn carrying all but the last item (the reply is it)."""
    seed = history_items(PRIOR_ITEMS - 1)
    ids: list[str] = []
    async with session(8) as http:

        async def one() -> None:
            async with http.post(f"{base}/v1/conversations", json={}, headers=HEADERS) as made:
                conversation = (await made.json())["id"]
            body = {"model": MODEL, "conversation": conversation, "input": seed}
            await post(f"{base}/v1/responses", encode(body))(http)
            ids.append(conversation)

        for start in range(0, count, 8):
            await asyncio.gather(*(one() for _ in range(min(8, count - start))))
    return ids


# --- processes ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, seconds: float, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise SystemExit(f"{process.args!r} exited with {process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # up, if unhappy with a bare GET
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{url} never came up")


@dataclass
class Server:
    name: str
    base: str
    process: subprocess.Popen[bytes]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def start_stub(*, exact: bool = False) -> Server:
    """The provider stub; `exact`: the tests' (it tokenizes each prompt), else the light."""
    port = free_port()
    mode = "exact" if exact else "light"
    process = subprocess.Popen(
        [sys.executable, "-c", STUB, str(port), mode],
        env=env(),
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    assert process.stdout is not None
    process.stdout.readline()
    return Server("direct", f"http://127.0.0.1:{port}", process)


def start_bare(stub: Server, tmp: Path) -> Server:
    """bench/bare_relay.py: the floor a Python hop pays, issue 23's baseline."""
    port = free_port()
    log = Path(tmp, "bare.log")
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "bare_relay.py"), str(port), stub.base],
            env=env(),
            stdout=sink,
            stderr=sink,
        )
    server = Server("bare", f"http://127.0.0.1:{port}", process)
    wait_ready(f"{server.base}/healthz", 30, process, log)
    return server


def serve_supports_workers() -> bool:
    shown = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--help"],
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return "--workers" in shown.stdout


def start_proxy(
    name: str,
    stub: Server,
    tmp: Path,
    *,
    workers: int | None,
    prefix: Sequence[str] = (),
    database: str | None = None,
    store: str | None = None,
) -> Server:
    """`store`: a store URL (PostgreSQL); else a SQLite file in `tmp` named for `database`
    or the proxy."""
    port = free_port()
    command = [
        *(prefix or [sys.executable]),
        "-m",
        "proxy",
        "serve",
        "--port",
        str(port),
        "--upstream",
        f"{stub.base}/v1",
        "--policies",
        str(tmp / "policies"),
        "--store",
        store or f"sqlite:///{tmp}/{database or name}.db",
    ]
    if workers is not None:
        command += ["--workers", str(workers)]
    # the worker count is the command line's alone
    proxy_env = {k: v for k, v in env().items() if k != "THREADKEEPER_WORKERS"}
    proxy_env["THREADKEEPER_LOG_LEVEL"] = "info"
    log = Path(tmp, f"{name}.log")
    with log.open("wb") as sink:  # the child keeps its own descriptor
        # cwd: `python -m` puts the working directory first on sys.path, before
        # PYTHONPATH, so a bench run from another checkout would serve that one's proxy/
        process = subprocess.Popen(command, env=proxy_env, stdout=sink, stderr=sink, cwd=ROOT)
    server = Server(name, f"http://127.0.0.1:{port}", process)
    wait_ready(f"{server.base}/healthz", 60, process, log)
    return server


def litellm_python(requested: str | None) -> tuple[str | None, str]:
    """An interpreter that imports `litellm.proxy.proxy_server`, or why there is none."""
    candidates = (
        [requested] if requested else [sys.executable, str(ROOT / ".venv-litellm/bin/python")]
    )
    for python in candidates:
        if not Path(python).exists():
            continue
        probe = subprocess.run(
            [
                python,
                "-c",
                "import litellm.proxy.proxy_server, importlib.metadata as m;"
                "print(m.version('litellm'))",
            ],
            env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode == 0:
            return python, probe.stdout.strip().splitlines()[-1]
    return None, "skipped: `litellm[proxy]` does not import here (see bench/overhead.py)"


def start_litellm(python: str, stub: Server, tmp: Path) -> Server:
    port = free_port()
    config = Path(tmp, "litellm.yaml")
    config.write_text(LITELLM_CONFIG.format(model=MODEL, stub_port=stub.base.rsplit(":", 1)[1]))
    log = Path(tmp, "litellm.log")
    sink = log.open("wb")
    process = subprocess.Popen(
        [
            python,
            "-m",
            "litellm.proxy.proxy_cli",
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ],
        env={
            **os.environ,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            # its lightest setup: no master key, so no per-request key check
            "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
        },
        stdout=sink,
        stderr=sink,
    )
    sink.close()  # the child keeps its own descriptor
    server = Server("litellm", f"http://127.0.0.1:{port}", process)
    wait_ready(f"{server.base}/health/liveliness", 120, process, log)
    return server


def resident_mb(pid: int) -> float:
    """VmRSS of `pid` and every process under it, in MB (worker processes count too)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    total_kb, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total_kb += int(line.split()[1])
    return total_kb / 1024


# --- the run --------------------------------------------------------------------------------


@dataclass
class Run:
    seconds: float
    workers_supported: bool
    litellm_version: str
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    rss: dict[str, float] = field(default_factory=dict)
    profiles: dict[str, list[str]] = field(default_factory=dict)
    profile_note: str = ""
    postgres: bool = False  # the Responses cells ran on PostgreSQL too
    load: float = 0.0  # of the machine when the run started: other work skews the figures
    started: str = ""
    commit: str = ""
    exact_stub: bool = False  # the tests' stub, tokenizing each prompt (else the light one)

    def cell(self, case: str, target: str) -> Cell:
        return self.cells.get((case, target)) or skipped("not run")


def measure(args: argparse.Namespace, tmp: Path) -> Run:
    python, litellm_note = litellm_python(args.litellm_python)
    run = Run(args.seconds, serve_supports_workers(), litellm_note)
    run.load = os.getloadavg()[0]
    run.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    run.commit = commit()
    run.exact_stub = args.exact_stub
    stub = start_stub(exact=args.exact_stub)
    servers: list[Server] = [stub]
    stack = contextlib.ExitStack()  # PostgreSQL schemas, dropped once the proxies stopped
    try:
        Path(tmp, "policies").mkdir()
        Path(tmp, "policies", "default.yaml").write_text(POLICY)
        bare = start_bare(stub, tmp)
        servers.append(bare)
        one = start_proxy("threadkeeper", stub, tmp, workers=1 if run.workers_supported else None)
        servers.append(one)
        two = None
        if run.workers_supported:
            two = start_proxy("threadkeeper-2w", stub, tmp, workers=2)
            servers.append(two)
        litellm = start_litellm(python, stub, tmp) if python else None
        if litellm:
            servers.append(litellm)
        on_pg: list[Server] = []
        for name, workers in (("threadkeeper-pg", 1), ("threadkeeper-pg-2w", 2)):
            if args.postgres and (workers == 1 or run.workers_supported):
                url = stack.enter_context(pg_schema(args.postgres))
                on_pg.append(start_proxy(name, stub, tmp, workers=workers, store=url))
                servers.append(on_pg[-1])
        run.postgres = bool(on_pg)
        asyncio.run(run_cells(run, stub, bare, one, two, litellm, on_pg, args.chat_only))
        run.rss["threadkeeper"] = resident_mb(one.process.pid)
        run.rss["bare"] = resident_mb(bare.process.pid)
        if litellm:
            run.rss["litellm"] = resident_mb(litellm.process.pid)
        for server in servers[1:]:
            server.stop()
        del servers[1:]
        profile(run, stub, tmp, args.profile)
    finally:
        for server in servers:
            server.stop()
        stack.close()
    return run


@contextlib.contextmanager
def pg_schema(dsn: str) -> Iterator[str]:
    """A store URL on a new schema of `dsn`'s database, dropped afterwards (the database
    may be shared: nothing else in it is touched)."""
    import asyncpg

    schema = f"tk_bench_{secrets.token_hex(6)}"

    async def execute(statement: str) -> None:
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    asyncio.run(execute(f"CREATE SCHEMA {schema}"))
    parts = urlsplit(dsn)
    query = urlencode([*parse_qsl(parts.query, keep_blank_values=True), ("schema", schema)])
    try:
        yield urlunsplit(parts._replace(query=query))
    finally:
        asyncio.run(execute(f"DROP SCHEMA {schema} CASCADE"))


def profile_only(args: argparse.Namespace, tmp: Path) -> list[list[str]]:
    """The profiles alone (to look at a change quickly): nothing is measured."""
    run = Run(args.seconds, False, "skipped")
    stub = start_stub(exact=args.exact_stub)
    try:
        Path(tmp, "policies").mkdir()
        Path(tmp, "policies", "default.yaml").write_text(POLICY)
        profile(run, stub, tmp, args.profile)
    finally:
        stub.stop()
    return [[run.profile_note], *run.profiles.values()]


async def run_cells(
    run: Run,
    stub: Server,
    bare: Server,
    one: Server,
    two: Server | None,
    litellm: Server | None,
    on_pg: Sequence[Server] = (),
    chat_only: bool = False,
) -> None:
    seconds = run.seconds
    chat, streamed = encode(chat_body()), encode(chat_body(stream=True))
    stateless = encode(stateless_responses_body())
    chat_path, responses_path = "/v1/chat/completions", "/v1/responses"
    unsupported = skipped("not supported by this build")
    no_litellm = skipped("skipped")
    passthrough = [stub, bare, one, two, litellm]
    servers = [server for server in passthrough if server is not None]
    chats: dict[str, Request | None] = {s.name: post(s.base + chat_path, chat) for s in servers}
    for name, cell in (await alternating(chats, seconds)).items():
        run.cells[("chat_1", name)] = cell
    for name, cell in (await in_rounds(chats, MANY, seconds)).items():
        run.cells[("chat_32", name)] = cell
    for label in ("chat_1", "chat_32"):
        run.cells.setdefault((label, "threadkeeper-2w"), unsupported)
        run.cells.setdefault((label, "litellm"), no_litellm)
    streams: dict[str, Request | None] = {
        s.name: first_byte(s.base + chat_path, streamed) for s in servers
    }
    for name, cell in (await alternating(streams, seconds)).items():
        run.cells[("ttfb", name)] = cell
    run.cells.setdefault(("ttfb", "threadkeeper-2w"), unsupported)
    run.cells.setdefault(("ttfb", "litellm"), no_litellm)
    if chat_only:
        return

    # Responses: stateless same-size requests direct and to LiteLLM, conversation turns
    # through threadkeeper (its conversations seeded before the clock starts).
    seeded: dict[str, tuple[list[str], list[str]]] = {}
    for server in (one, two, *on_pg):
        if server is not None:
            single = await seed_conversations(server.base, SINGLE_CONVERSATIONS + 1)
            many = await seed_conversations(server.base, MANY * CONVERSATIONS_PER_CLIENT)
            await conversation_turns(server.base, single[-1:], 1, seconds)  # warm-up
            seeded[server.name] = (single[:-1], many)
    stateful = [server for server in (one, two, *on_pg) if server is not None]
    singles: dict[str, Request | None] = {
        s.name: post(s.base + responses_path, stateless) for s in (stub, bare)
    }
    if litellm:
        singles["litellm"] = post(litellm.base + responses_path, stateless)
    for server in stateful:
        singles[server.name] = turns_of(server.base, seeded[server.name][0], TURNS_PER_CONVERSATION)
    for name, cell in (await alternating(singles, seconds)).items():
        run.cells[("responses_1", name)] = cell
    many = {s.name: post(s.base + responses_path, stateless) for s in (stub, bare)}
    for name, cell in (await in_rounds(many, MANY, seconds)).items():
        run.cells[("responses_32", name)] = cell
    for server in stateful:
        run.cells[("responses_32", server.name)] = await conversation_turns(
            server.base, seeded[server.name][1], MANY, seconds + 2
        )
    if litellm:
        run.cells[("responses_32", "litellm")] = await timed(
            post(litellm.base + responses_path, stateless), MANY, seconds
        )
    for label in ("responses_1", "responses_32"):
        run.cells.setdefault((label, "threadkeeper-2w"), unsupported)
        run.cells.setdefault((label, "litellm"), no_litellm)


def profile(run: Run, stub: Server, tmp: Path, cases: Sequence[str]) -> None:
    """Each profiled case in a fresh proxy under pyinstrument, then its heaviest frames."""
    try:
        from pyinstrument.session import Session
    except ImportError:
        run.profile_note = "skipped: pyinstrument is not installed (`pip install -e '.[bench]'`)"
        return
    conversations: list[str] = []
    if "responses" in cases:
        # The conversations are seeded by a proxy that is not profiled, on the same database.
        seeder = start_proxy("seeder", stub, tmp, workers=None)
        try:
            conversations = asyncio.run(seed_conversations(seeder.base, PROFILE_CONVERSATIONS))
        finally:
            seeder.stop()

    async def hammer_turns(proxy: Server, seconds: float) -> int:
        """Turns on the seeded 200-item conversations, one client."""
        cell = await conversation_turns(proxy.base, conversations, 1, seconds * 4, PROFILE_TURNS)
        return len(cell.latencies)

    drivers: dict[str, Callable[[Server, float], Awaitable[int]]] = {
        "passthrough": hammer_chat(PROFILE_CLIENTS),
        "passthrough-1": hammer_chat(1),
        "passthrough-32": hammer_chat(MANY),
        "streamed": hammer_streams,
        "responses": hammer_turns,
    }
    for case in cases:
        drive = drivers[case]
        session_file = Path(tmp, f"profile-{case}.pyisession")
        prefix = [sys.executable, "-m", "pyinstrument", "-r", "pyisession", "-o", str(session_file)]
        database = "seeder" if case == "responses" else None
        proxy = start_proxy(
            f"profiled-{case}", stub, tmp, workers=None, prefix=prefix, database=database
        )
        try:
            requests = asyncio.run(drive(proxy, run.seconds))
        finally:
            proxy.stop(signal.SIGINT)
        if not session_file.exists():
            run.profile_note = (
                "skipped: pyinstrument wrote no session (did the proxy exit cleanly?)"
            )
            return
        samples = handler_samples(Session.load(str(session_file)).frame_records)
        if not samples:
            run.profile_note = (
                "skipped: no samples inside the profiled process's event loop (does `serve` "
                "run its requests in child processes?)"
            )
            return
        run.profiles[case] = profile_report(samples, requests)


def hammer_chat(clients: int) -> Callable[[Server, float], Awaitable[int]]:
    """The passthrough under load: `clients` clients for `seconds`; requests sent."""

    async def drive(proxy: Server, seconds: float) -> int:
        request = post(proxy.base + "/v1/chat/completions", encode(chat_body()))
        return len((await timed(request, clients, seconds)).latencies) + WARMUP

    return drive


async def hammer_streams(proxy: Server, seconds: float) -> int:
    """Streamed chat, 1 client, each stream read to its end, for `seconds`."""
    request = first_byte(proxy.base + "/v1/chat/completions", encode(chat_body(stream=True)))
    return len((await timed(request, 1, seconds)).latencies) + WARMUP


# One sample: the frames from the event loop's callback down (outermost first), seconds.
Sample = tuple[list[str], float]


def handler_samples(records: Sequence[Any]) -> list[Sample]:
    """The samples taken inside an event-loop callback: the proxy's own work. On asyncio's
    loop a callback runs under `Handle._run`; on uvloop (C) a callback's Python frames
    sit right under `Runner.run`, and a sample with nothing under it is the loop idling.
    Start-up, shutdown and idle waiting in the selector fall outside."""
    samples = []
    for stack, seconds in records:
        where = [tuple(frame.split("\x00")[:2]) for frame in stack]
        top = _loop_frame(where, "_run", "asyncio/events.py")
        if top is None:  # uvloop; asyncio's own loop idling puts asyncio/ frames there
            top = _loop_frame(where, "run", "asyncio/runners.py")
            if top is not None and top + 1 < len(where) and "/asyncio/" in where[top + 1][1]:
                top = None
        if top is not None and (callback := stack[top + 1 :]):
            samples.append(([frame_label(f) for f in callback], seconds))
    return samples


def _loop_frame(where: Sequence[tuple[str, ...]], name: str, path: str) -> int | None:
    for index, (frame_name, frame_path) in enumerate(where):
        if frame_name == name and frame_path.endswith(path):
            return index
    return None


def frame_label(identifier: str) -> str:
    """pyinstrument's "function\\0path\\0line\\1cClass..." as "Class.function  path:line"."""
    name, path, line = identifier.split("\x00")[:3]
    line, *attributes = line.split("\x01")
    owner = next((a[1:] for a in attributes if a.startswith("c")), "")
    return f"{owner + '.' if owner else ''}{name}  {short_path(path)}:{line}"


def short_path(path: str) -> str:
    for marker in ("/site-packages/", f"{ROOT}/", "/lib/python3.11/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def is_project(label: str) -> bool:
    return "  proxy/" in label


def package_of(stack: Sequence[str]) -> str:
    """Where a sample's time went: the innermost frame's package; a built-in counts for
    the frame that called it."""
    for label in reversed(stack):
        path = label.split("  ", 1)[1]
        if not path.startswith("<"):
            return path.split("/", 1)[0].split(":")[0].removesuffix(".py")
    return "<built-in>"


def profile_report(samples: Sequence[Sample], requests: int) -> list[str]:
    total = sum(seconds for _, seconds in samples)
    tree: dict[str, Any] = {}
    for stack, seconds in samples:
        # pyinstrument's folding: a library frame shows only where project code calls it
        shown = [
            label
            for index, label in enumerate(stack)
            if index == 0 or is_project(label) or is_project(stack[index - 1])
        ]
        node = tree
        for label in shown:
            entry = node.setdefault(label, [0.0, {}])
            entry[0] += seconds
            node = entry[1]
    lines = [
        f"Callback time in the proxy: {total * 1000 / requests:.2f} ms per request under the "
        f"profiler ({requests} requests). The call tree, library internals folded (share "
        "of that time, branches under 2% left out):",
        "",
        "```",
    ]
    lines += tree_lines(tree, total, depth=0)[: PROFILE_LINES * 2]
    packages: dict[str, float] = {}
    functions: dict[str, float] = {}
    for stack, seconds in samples:
        packages[package_of(stack)] = packages.get(package_of(stack), 0.0) + seconds
        leaf = stack[-1] if stack else "<loop>"
        functions[leaf] = functions.get(leaf, 0.0) + seconds
    lines += ["```", "", f"Top {PROFILE_LINES} functions by self time:", "", "```"]
    for label, seconds in sorted(functions.items(), key=lambda kv: -kv[1])[:PROFILE_LINES]:
        lines.append(f"{seconds / total:6.1%}  {label}")
    lines += [
        "```",
        "",
        "Self time by package: "
        + ", ".join(
            f"{name} {seconds / total:.0%}"
            for name, seconds in sorted(packages.items(), key=lambda kv: -kv[1])
            if seconds / total >= 0.01
        )
        + ".",
    ]
    return lines


def tree_lines(node: dict[str, Any], total: float, depth: int) -> list[str]:
    lines = []
    for label, (seconds, children) in sorted(node.items(), key=lambda kv: -kv[1][0]):
        if seconds / total < 0.02:
            continue
        lines.append(f"{'  ' * depth}{seconds / total:6.1%}  {label}")
        lines += tree_lines(children, total, depth + 1)
    return lines


# --- the report -----------------------------------------------------------------------------


def render(run: Run, title: str) -> str:
    d = run.cell

    def added_ms(case: str, target: str) -> float:
        return d(case, target).p50 - d(case, "direct").p50

    def added(case: str, target: str) -> str:
        cell = d(case, target)
        if not cell.ok:
            return cell.note
        return f"{cell.p50:.2f} ms (+{added_ms(case, target):.2f})"

    def share(case: str, target: str) -> str:
        cell = d(case, target)
        if not cell.ok:
            return cell.note
        return f"{cell.rps:,.0f} ({cell.rps / d(case, 'direct').rps:.0%})"

    def times_bare(case: str) -> float:
        return added_ms(case, "threadkeeper") / max(added_ms(case, "bare"), 0.01)

    def of_bare(case: str) -> float:
        return d(case, "threadkeeper").rps / d(case, "bare").rps

    def met(ok: bool) -> str:
        return "**met**" if ok else "not met"

    def latency_row(case: str, direct_note: str, limit: float) -> list[str]:
        ratio = times_bare(case)
        return [
            TARGETS[case],
            f"{d(case, 'direct').p50:.2f} ms{direct_note}",
            added(case, "bare"),
            added(case, "threadkeeper"),
            added(case, "threadkeeper-2w"),
            added(case, "litellm"),
            f"{ratio:.1f}x the hop's added",
            f"<= {limit:g}x",
            met(ratio <= limit),
        ]

    def throughput_row(case: str, direct_note: str, floor: float) -> list[str]:
        ratio = of_bare(case)
        return [
            TARGETS[case],
            f"{d(case, 'direct').rps:,.0f}{direct_note}",
            share(case, "bare"),
            share(case, "threadkeeper"),
            share(case, "threadkeeper-2w"),
            share(case, "litellm"),
            f"{ratio:.0%} of the hop's",
            f">= {floor:.0%}",
            met(ratio >= floor),
        ]

    stateless = " (stateless)"
    rows = [
        latency_row("chat_1", "", 2),
        throughput_row("chat_32", "", 0.70),
        *(
            [
                latency_row("responses_1", stateless, 3),
                throughput_row("responses_32", stateless, 0.40),
            ]
            if d("responses_1", "direct").ok
            else []
        ),
        latency_row("ttfb", "", 2),
        [
            TARGETS["rss"],
            "",
            f"{run.rss['bare']:.0f} MB",
            f"{run.rss['threadkeeper']:.0f} MB",
            "",
            f"{run.rss['litellm']:.0f} MB" if "litellm" in run.rss else "skipped",
            "",
            "<= 200 MB",
            met(run.rss["threadkeeper"] <= 200),
        ],
    ]
    litellm_name = (
        f"LiteLLM {run.litellm_version}"
        if not run.litellm_version.startswith("skipped")
        else "LiteLLM"
    )
    stub_note = "exact: it tokenizes each prompt" if run.exact_stub else "light: item counts kept"
    lines = [
        f"## {title}",
        "",
        f"`python bench/overhead.py --write` on {run.started} at commit {run.commit} "
        f"({run.seconds:g} s per cell, Python {sys.version.split()[0]}, {os.cpu_count()} "
        f"cores, 1-minute load average {run.load:.1f} when it started). The provider stub "
        f"({stub_note}), "
        "the bare relay (bench/bare_relay.py: read the body, forward it with one "
        "`ClientSession`, stream the answer back, on uvloop like `serve`), each proxy and "
        "the aiohttp client are separate processes on one machine shared with other work, "
        "so absolute figures are noisy: read the ratios to the bare relay, which come from "
        'one run with the targets measured in turn cell by cell. "+x" is the p50 added '
        "over direct; the targets are issue 23's.",
        "",
        "| measure | direct | bare relay | threadkeeper, 1 worker | threadkeeper, 2 workers "
        f"| {litellm_name} | threadkeeper (1 worker) vs bare | target | |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if run.litellm_version.startswith("skipped"):
        lines += ["", f"LiteLLM {run.litellm_version}."]
    if run.postgres:
        lines += ["", *postgres_lines(run)]
    lines += [
        "",
        "threadkeeper runs on SQLite but in the PostgreSQL rows. The Responses turn: each of "
        f"{SINGLE_CONVERSATIONS} (1 client) or {MANY * CONVERSATIONS_PER_CLIENT} (32 "
        f"clients) conversations is seeded with {PRIOR_ITEMS} items through the proxy and "
        f"takes up to {TURNS_PER_CONVERSATION} turns of one new user message; direct, the "
        "bare relay and LiteLLM get the same 200 items statelessly. Memory: VmRSS of each "
        "proxy's process tree after every cell above.",
        "",
        "Every cell:",
        "",
        "| case | target | requests | p50 ms | p99 ms | req/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (case, target), cell in run.cells.items():
        if cell.ok:
            lines.append(
                f"| {case} | {target} | {len(cell.latencies)} | {cell.p50:.2f} | "
                f"{cell.p99:.2f} | {cell.rps:,.0f} |"
            )
    if run.profile_note:
        lines += ["", "### Profile", "", run.profile_note]
    for case, report in run.profiles.items():
        lines += ["", f"### Profile: {PROFILED[case]}", "", *report]
    return "\n".join(lines) + "\n"


def postgres_lines(run: Run) -> list[str]:
    """The Responses cells on PostgreSQL (`--postgres`), 1 and 2 workers, against the hop."""
    d = run.cell
    rows = [
        "| Responses turn, 200-item conversation, threadkeeper on PostgreSQL | 1 worker "
        "| 2 workers | 1 worker on SQLite |",
        "|---|---:|---:|---:|",
    ]
    names = ("threadkeeper-pg", "threadkeeper-pg-2w", "threadkeeper")

    def added(name: str) -> str:
        cell, bare = d("responses_1", name), d("responses_1", "bare")
        if not cell.ok:
            return cell.note
        hop = max(bare.p50 - d("responses_1", "direct").p50, 0.01)
        extra = cell.p50 - d("responses_1", "direct").p50
        return f"+{extra:.2f} ms ({extra / hop:.1f}x the hop's)"

    def share(name: str) -> str:
        cell = d("responses_32", name)
        if not cell.ok:
            return cell.note
        return f"{cell.rps:,.0f} ({cell.rps / d('responses_32', 'bare').rps:.0%} of the hop's)"

    rows.append("| 1 client: added p50 | " + " | ".join(added(n) for n in names) + " |")
    rows.append("| 32 clients: requests/s | " + " | ".join(share(n) for n in names) + " |")
    return rows


PROFILED = {
    "passthrough": f"the chat passthrough, {PROFILE_CLIENTS} clients",
    "passthrough-1": "the chat passthrough, 1 client",
    "passthrough-32": f"the chat passthrough, {MANY} clients",
    "streamed": "the streamed chat, 1 client",
    "responses": f"Responses turns on {PROFILE_CONVERSATIONS} conversations of "
    f"{PRIOR_ITEMS} items (up to {PROFILE_TURNS} turns each), 1 client",
}


def commit() -> str:
    shown = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%h"],
        capture_output=True,
        text=True,
        check=False,
    )
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "proxy"],
        capture_output=True,
        text=True,
        check=False,
    )
    return shown.stdout.strip() + (
        " (with uncommitted changes to proxy/)" if dirty.stdout.strip() else ""
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0, help="per cell")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    parser.add_argument("--litellm-python", help="an interpreter with litellm[proxy]")
    parser.add_argument("--output", type=Path, help="also write the section to this file")
    parser.add_argument("--title", default="Overhead", help="the section of bench/RESULTS.md")
    parser.add_argument("--profile-only", action="store_true", help="print the profiles only")
    parser.add_argument(
        "--postgres", metavar="DSN", help="also run the Responses cells on this PostgreSQL"
    )
    parser.add_argument("--chat-only", action="store_true", help="the chat cells alone")
    parser.add_argument(
        "--exact-stub", action="store_true", help="the tests' stub, which tokenizes prompts"
    )
    parser.add_argument(
        "--profile",
        type=lambda text: [case for case in text.split(",") if case],
        default=["passthrough", "responses"],
        help=f"the profiled cases, comma-separated ({', '.join(PROFILED)}; none: '')",
    )
    args = parser.parse_args()
    if unknown := set(args.profile) - set(PROFILED):
        parser.error(f"--profile: no case {', '.join(sorted(unknown))}")
    if args.profile_only:
        with tempfile.TemporaryDirectory() as tmp:
            print("\n\n".join("\n".join(lines) for lines in profile_only(args, Path(tmp))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        run = measure(args, Path(tmp))
    report = render(run, args.title)
    print(report)
    if args.output:
        args.output.write_text(report, encoding="utf-8")
    if args.write:
        write_section(args.title, report)


if __name__ == "__main__":
    main()
