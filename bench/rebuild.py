"""Turn latency against conversation length, through the HTTP path (SPEC 5 and 7).

    python bench/rebuild.py [--turns 21] [--write]

A store reads only the live window (the items from the thread's sticky cut on), so one
turn on a 10,000-item conversation should cost about what it costs on a 100-item one when
both have the same live window. Three conversations are seeded straight into a SQLite
store, with token counts, as the thread service writes them:

- 100 items, never cut: the whole history is live;
- 10,000 items whose state cuts at ~100 items from the end (a summary of the rest, as
  proxy/core/checkpoint.py stores it): the same live window;
- 10,000 items, never cut, under a window they fit in: the whole history is live
  (informational: this is the cost the cut avoids).

The proxy then runs as `python -m proxy serve` on that file with the fake provider in
this process, and each conversation gets `--turns` turns (`POST /v1/responses` with
`conversation`), round-robin so machine load hits the cases alike, after warm-up turns.
Reports median latency per case and the ratios; --write replaces "## Rebuild" in
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from results import write_section

from proxy.core.checkpoint import cut_to_state
from proxy.core.items import Item, responses_item
from proxy.core.memory import summarize_turns
from proxy.core.projection import CutPoint
from proxy.core.tokens import TokenCounter
from proxy.fake_provider import FakeProvider
from proxy.store import open_store
from proxy.store.base import NewItem, Store

ROOT = Path(__file__).resolve().parent.parent
TENANT = "default"
MODEL = "gpt-4o"
NOW = "2025-01-01T00:00:00+00:00"
BATCH = 500
WARMUP_TURNS = 3
SUMMARY_TOKENS = 1_000

# A window the 10,000-item history fits in (about 250,000 tokens), so "whole history
# live" really sends it all rather than cutting on the first turn.
POLICY = """\
tenant: default
allow_unknown_keys: true
models:
  "*": {context_window: 1000000, max_output_tokens: 4096}
budget: {reserve_output_tokens: 1000, safety_margin_tokens: 200}
"""


@dataclass(frozen=True)
class Case:
    name: str
    items: int
    live: int | None  # items left live by the seeded cut; None: never cut


SMALL = Case("small", 100, None)
CUT = Case("cut", 10_000, 100)
WHOLE = Case("whole", 10_000, None)
CASES = (SMALL, CUT, WHOLE)


def history(size: int) -> list[Item]:
    """Support-desk turns in the Responses item format: user, tool call, tool result,
    answer."""
    items: list[Item] = []
    n = 0
    while len(items) < size:
        call = f"call_{n}"
        result = {"order": n, "status": "shipped", "lines": [f"sku-{i}" for i in range(12)]}
        raws: list[dict[str, Any]] = [
            {"id": f"msg_u{n}", "type": "message", "role": "user", "content": f"Where is {n}?"},
            {
                "id": f"fc_{n}",
                "type": "function_call",
                "call_id": call,
                "name": "lookup_order",
                "arguments": json.dumps({"order": n}),
            },
            {
                "id": f"fco_{n}",
                "type": "function_call_output",
                "call_id": call,
                "output": json.dumps(result),
            },
            {
                "id": f"msg_a{n}",
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"Order {n} has shipped."}],
            },
        ]
        items.extend(responses_item(raw) for raw in raws)
        n += 1
    return items[:size]


def cut_state(items: list[Item], live: int, counter: TokenCounter) -> dict[str, Any]:
    """The thread state of a conversation cut at the first user message that leaves
    about `live` items, with a digest of everything before it."""
    start = len(items) - live
    while not items[start].is_user_message:
        start -= 1
    digest = summarize_turns(items[:start], counter, SUMMARY_TOKENS)
    return cut_to_state(CutPoint(start=start, summary=(digest,)))


async def seed(store: Store, case: Case, counter: TokenCounter) -> None:
    items = history(case.items)
    await store.create_thread(TENANT, f"conv_{case.name}", kind="conversation", now=NOW)
    for first in range(0, len(items), BATCH):
        batch = [
            NewItem(
                item_id=str(item.raw["id"]),
                raw=item.raw,
                api="responses",
                tokens=counter.item(item),
                encoding=counter.tokenizer_id,
            )
            for item in items[first : first + BATCH]
        ]
        await store.append_items(TENANT, f"conv_{case.name}", batch, now=NOW)
    if case.live is not None:
        state = cut_state(items, case.live, counter)
        await store.append_items(TENANT, f"conv_{case.name}", [], state=state, now=NOW)


async def seed_all(url: str) -> None:
    store = await open_store(url)
    try:
        await store.migrate()
        counter = TokenCounter.for_model(MODEL)
        for case in CASES:
            await seed(store, case, counter)
    finally:
        await store.close()


async def live_items(url: str) -> dict[str, int]:
    """How many items each conversation's live window holds now."""
    store = await open_store(url)
    try:
        windows = {c.name: await store.load_window(TENANT, f"conv_{c.name}") for c in CASES}
    finally:
        await store.close()
    return {name: len(window.items) if window else 0 for name, window in windows.items()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(port: int, store_url: str, policies: Path, upstream: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "proxy", "serve", "--port", str(port)]
    command += ["--store", store_url, "--policies", str(policies), "--upstream", upstream]
    env = {k: v for k, v in os.environ.items() if not k.startswith("THREADKEEPER_")}
    env.update(PYTHONPATH=str(ROOT), THREADKEEPER_LOG_LEVEL="warning")
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


async def wait_ready(client: httpx.AsyncClient, proxy: subprocess.Popen[bytes]) -> None:
    for _ in range(300):
        if proxy.poll() is not None:
            raise SystemExit("the proxy exited before it was ready")
        try:
            if (await client.get("/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit("the proxy was not ready in 30 s")


@dataclass
class Timing:
    latencies: list[float]
    context_tokens: list[int]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.latencies) * 1000


async def one_turn(client: httpx.AsyncClient, case: Case, turn: int) -> tuple[float, int]:
    body = {"model": MODEL, "conversation": f"conv_{case.name}", "input": f"Turn {turn}: news?"}
    started = time.perf_counter()
    response = await client.post("/v1/responses", json=body)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise SystemExit(f"{case.name}: {response.status_code} {response.text[:300]}")
    return elapsed, int(response.headers["x-threadkeeper-context-tokens"])


async def drive(client: httpx.AsyncClient, turns: int) -> dict[str, Timing]:
    timings = {case.name: Timing([], []) for case in CASES}
    for turn in range(WARMUP_TURNS + turns):
        for case in CASES:
            elapsed, tokens = await one_turn(client, case, turn)
            if turn >= WARMUP_TURNS:
                timings[case.name].latencies.append(elapsed)
                timings[case.name].context_tokens.append(tokens)
    return timings


async def measure(workdir: Path, turns: int) -> tuple[dict[str, Timing], dict[str, int]]:
    """Seeds the store in `workdir` (which holds the policy), serves it, drives turns."""
    store_url = f"sqlite:///{workdir}/rebuild.db"
    began = time.perf_counter()
    await seed_all(store_url)
    print(f"seeded in {time.perf_counter() - began:.1f} s", file=sys.stderr)
    async with FakeProvider() as provider:
        assert provider.base_url is not None
        port = free_port()
        proxy = serve(port, store_url, workdir, provider.base_url)
        headers = {"Authorization": "Bearer sk-bench"}
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as client:
                await wait_ready(client, proxy)
                timings = await drive(client, turns)
        finally:
            proxy.terminate()
            proxy.wait()
    return timings, await live_items(store_url)


def section(timings: dict[str, Timing], live: dict[str, int], turns: int) -> str:
    labels = {
        "small": "100 items, whole history live",
        "cut": "10,000 items, cut to ~100 live",
        "whole": "10,000 items, whole history live",
    }
    rows = "\n".join(
        f"| {labels[c.name]} | {live[c.name]:,} | "
        f"{statistics.median(timings[c.name].context_tokens):,.0f} | "
        f"{timings[c.name].median_ms:.1f} |"
        for c in CASES
    )
    small, cut, whole = (timings[c.name].median_ms for c in CASES)
    return f"""## Rebuild

`python bench/rebuild.py` (Python {platform.python_version()}, {platform.machine()}).
One non-streamed `POST /v1/responses` turn with `conversation`, through the proxy served
by `python -m proxy serve` on a SQLite file, the fake provider on loopback, the client
httpx. Conversations seeded directly in the store with token counts; the cut one has a
state whose `window_start` leaves about 100 items live (the rest summarized), the way the
thread service writes it. Median of {turns} turns per case after {WARMUP_TURNS} warm-up
turns, the cases interleaved turn by turn. Each turn adds 2 items, so the live windows
grow by {2 * (turns + WARMUP_TURNS)} items over the run ("live items" is at the end).

| conversation | live items | context tokens sent | turn ms (median) |
|---|---:|---:|---:|
{rows}

| ratio | value |
|---|---:|
| 10,000 / 100 items, same live window | **{cut / small:.2f}** |
| 10,000 / 100 items, whole history live (informational) | {whole / small:.2f} |

Target: 10,000 / 100 <= 1.5 with the same live window. The turn costs what its live
window costs (load, projection, provider round trip, commit); a thread never cut pays for
its whole history on every turn.
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=21, help="timed turns per case")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "default.yaml").write_text(POLICY)
        timings, live = asyncio.run(measure(Path(tmp), args.turns))
    text = section(timings, live, args.turns)
    print(text)
    if args.write:
        write_section("Rebuild", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
