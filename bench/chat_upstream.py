"""A Responses turn over a Chat-only provider (translated) vs over a Responses provider
(native), both through threadkeeper, one run (issue 25).

    python bench/chat_upstream.py [--requests 300] [--write]

Two provider stubs (`FakeProvider`, one with `chat_only=True`), two proxies
(`python -m proxy serve`, the second with `upstream.api: chat`) and this client, each its
own process, as in bench/overhead.py. The turn: a stateless `POST /v1/responses` with a
40-item agent history (questions, function calls and their outputs, answers), JSON and
streamed (the whole stream read). The native and translated cells take turns request by
request, so load drift hits them alike; then, in a second round of the same kind, each
turn is sent straight to its stub and as a Chat client's request through the proxy (the
references). --profile: the translated JSON turn under pyinstrument instead. --write
replaces the "## Chat-only upstreams" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from overhead import (
    MODEL,
    WARMUP,
    Cell,
    Request,
    Server,
    encode,
    env,
    free_port,
    handler_samples,
    history_items,
    post,
    profile_report,
    session,
    start_proxy,
)
from results import write_section

ITEMS = 40
STUB = """
import asyncio, sys
from proxy.fake_provider import FakeProvider
async def main():
    provider = FakeProvider(chat_only=sys.argv[2] == "chat")
    await provider.start(port=int(sys.argv[1]))
    print("ready", flush=True)
    while True:
        await asyncio.sleep(1)
        provider.requests.clear()
asyncio.run(main())
"""
POLICY = """\
tenant: default
allow_unknown_keys: true
upstream: {{api: {api}}}
models:
  "*": {{context_window: 128000, max_output_tokens: 1000}}
"""


def start_stub(kind: str) -> Server:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", STUB, str(port), kind], env=env(), stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    process.stdout.readline()
    return Server(f"{kind} stub", f"http://127.0.0.1:{port}", process)


def responses_body(stream: bool) -> dict[str, Any]:
    items = [*history_items(ITEMS - 1), {"role": "user", "content": "And the next order?"}]
    return {"model": MODEL, "input": items, "store": False, "stream": stream}


def chat_body(stream: bool) -> dict[str, Any]:
    """What the proxy sends the Chat stub for the same turn (the direct Chat baseline)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from proxy.core.chat_translate import chat_request

    return chat_request(responses_body(stream), ids=lambda prefix: f"{prefix}_1")


def proxy_in_front(stub: Server, api: str, tmp: Path, prefix: Sequence[str] = ()) -> Server:
    home = tmp / api
    (home / "policies").mkdir(parents=True)
    (home / "policies" / "default.yaml").write_text(POLICY.format(api=api))
    return start_proxy(f"proxy-{api}", stub, home, workers=None, prefix=prefix)


async def run(requests: int) -> dict[str, Cell]:
    with tempfile.TemporaryDirectory() as tmp:
        native_stub, chat_stub = start_stub("responses"), start_stub("chat")
        servers = [native_stub, chat_stub]
        try:
            native = proxy_in_front(native_stub, "responses", Path(tmp))
            servers.append(native)
            chat = proxy_in_front(chat_stub, "chat", Path(tmp))
            servers.append(chat)
            compared: dict[str, Request] = {}
            references: dict[str, Request] = {}
            for stream in (False, True):
                kind = "stream" if stream else "json"
                body = encode(responses_body(stream))
                direct_chat = encode(chat_body(stream))
                compared |= {
                    f"native {kind}": post(f"{native.base}/v1/responses", body),
                    f"translated {kind}": post(f"{chat.base}/v1/responses", body),
                }
                references |= {
                    f"direct responses {kind}": post(f"{native_stub.base}/v1/responses", body),
                    f"direct chat {kind}": post(
                        f"{chat_stub.base}/v1/chat/completions", direct_chat
                    ),
                    f"chat client {kind}": post(f"{chat.base}/v1/chat/completions", direct_chat),
                }
            # The compared cells alone, then the references: a reference cell between two
            # compared ones changed which process had just run and moved the ratio.
            cells = await interleaved(compared, requests)
            cells |= await interleaved(references, requests)
            for api, name in (("responses", "native"), ("chat", "translated")):
                own = proxy_own_ms(Path(tmp) / api / f"proxy-{api}.log")
                cells[f"{name} json own"] = Cell(own[WARMUP:])
            return cells
        finally:
            for server in servers:
                server.stop()


async def interleaved(targets: dict[str, Request], requests: int) -> dict[str, Cell]:
    """One request to each target in turn, `requests` times (after WARMUP rounds), so a
    load spike on the shared machine hits every cell alike."""
    cells = {name: Cell() for name in targets}
    async with session(1) as http:
        for round_number in range(WARMUP + requests):
            for name, request in targets.items():
                elapsed = await request(http)
                if round_number >= WARMUP:
                    cells[name].latencies.append(elapsed)
    return cells


def proxy_own_ms(log: Path) -> list[float]:
    """The proxy's own time of each JSON turn (seconds), from its log lines: latency_ms
    minus upstream_ms (the stub's part, to its headers). The chat proxy's log lines of
    /v1/responses alternate JSON and streamed turns (its Chat client turns are others)."""
    own = []
    for line in log.read_text(errors="replace").splitlines():
        latency = re.search(r"latency_ms\W+([0-9.]+)", line)
        upstream = re.search(r"upstream_ms\W+([0-9.]+)", line)
        if latency and upstream and "/v1/responses" in line:
            own.append((float(latency.group(1)) - float(upstream.group(1))) / 1000)
    return own[0::2]


def render(cells: dict[str, Cell], requests: int) -> str:
    lines = [
        "## Chat-only upstreams",
        "",
        f"`python bench/chat_upstream.py --requests {requests} --write`"
        f" (Python {sys.version.split()[0]}): a stateless Responses turn with a {ITEMS}-item"
        " agent history (function calls and outputs included), 1 client, p50 of each; the"
        " native and translated cells interleaved request by request, then the references"
        ' (each stub direct, the Chat client) likewise. "native": threadkeeper in front of'
        " a Responses stub;"
        ' "translated": in front of a Chat-only stub (`upstream.api: chat`). "added" is'
        " the proxy's p50 minus its stub's direct p50 (the stubs build different bodies).",
        "",
        "| turn | native ms | translated ms | translated / native | native added ms"
        " | translated added ms | added ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in ("json", "stream"):
        native = cells[f"native {kind}"].p50
        translated = cells[f"translated {kind}"].p50
        added_native = native - cells[f"direct responses {kind}"].p50
        added_chat = translated - cells[f"direct chat {kind}"].p50
        lines.append(
            f"| {kind} | {native:.2f} | {translated:.2f} | **{translated / native:.2f}** |"
            f" {added_native:.2f} | {added_chat:.2f} | {added_chat / added_native:.2f} |"
        )
    native_own = cells["native json own"].p50
    translated_own = cells["translated json own"].p50
    lines += [
        "",
        "Translated against the same turn sent by a Chat Completions client through the same"
        " proxy to the same Chat stub (the translation's own cost; the client cell is in the"
        " references' round): "
        + "; ".join(
            f"{kind} {cells[f'translated {kind}'].p50:.2f} vs"
            f" {cells[f'chat client {kind}'].p50:.2f} ms,"
            f" ratio **{cells[f'translated {kind}'].p50 / cells[f'chat client {kind}'].p50:.2f}**"
            for kind in ("json", "stream")
        )
        + ".",
        "",
        "The proxy's own time of a JSON turn (its log's latency_ms minus upstream_ms, so no"
        f" stub is in it): native {native_own:.2f} ms, translated {translated_own:.2f} ms,"
        f" ratio **{translated_own / native_own:.2f}**.",
        "",
        f"Target: translated / native <= 1.2. {requests} requests per cell. The machine is"
        " shared with other jobs: the end-to-end cells move between runs by more than the"
        " translation costs; the proxy's own time is the steadier figure.",
    ]
    return "\n".join(lines)


def profile(requests: int) -> list[str]:
    """The translated JSON turn sent `requests` times to a proxy under pyinstrument: the
    heaviest frames of the proxy's own callbacks (bench/overhead.py's report)."""
    from pyinstrument.session import Session

    with tempfile.TemporaryDirectory() as tmp:
        session_file = Path(tmp, "chat.pyisession")
        prefix = [sys.executable, "-m", "pyinstrument", "-r", "pyisession", "-o", str(session_file)]
        stub = start_stub("chat")
        try:
            proxy = proxy_in_front(stub, "chat", Path(tmp), prefix)
            try:
                target = {
                    "translated json": post(
                        f"{proxy.base}/v1/responses", encode(responses_body(False))
                    )
                }
                asyncio.run(interleaved(target, requests))
            finally:
                proxy.stop(signal.SIGINT)
        finally:
            stub.stop()
        samples = handler_samples(Session.load(str(session_file)).frame_records)
        return profile_report(samples, requests + WARMUP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--profile", action="store_true", help="profile the translated JSON turn")
    args = parser.parse_args()
    if args.profile:
        print("\n".join(profile(args.requests)))
        return
    cells = asyncio.run(run(args.requests))
    section = render(cells, args.requests)
    print(section)
    print(
        json.dumps({k: round(statistics.median(v.latencies) * 1000, 3) for k, v in cells.items()})
    )
    if args.write:
        write_section("Chat-only upstreams", section)


if __name__ == "__main__":
    main()
