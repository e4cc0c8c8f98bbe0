"""Two builds of the proxy in one run: the chat passthrough's CPU per request and p50.

    python bench/chat_ab.py ROOT_A,ROOT_B[,...] [--requests 2000] [--stream] [--clients 1]

Each ROOT is a tree holding `proxy/` (a `git archive` of another commit, say); a root
may carry environment variables after "|" ("ROOT|THREADKEEPER_EXPLAIN=false"). The
provider stub, the bare relay (bench/bare_relay.py) and one `serve` per root run as
separate processes; one client sends bench/overhead.py's chat body to each in turn, in
five rounds, so a change of the machine's load falls on every target alike. Reported per
target: the CPU time its process tree spent per request (user + system, from /proc: on a
shared machine steadier than latencies, which the scheduler moves), the p50, the p50
added over direct and that as a multiple of the bare relay's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import overhead as o


def cpu_seconds(pid: int) -> float:
    """User + system time of `pid` and its children (`serve --workers` forks)."""
    total = 0
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    for process in [pid, *map(int, children.stdout.split())]:
        fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def serve_command(
    name: str, spec: str, stub: o.Server, tmp: Path, port: int
) -> tuple[str, list[str], dict[str, str]]:
    """The root, command and environment of one `serve` (one worker, SQLite) of a build
    spec ("ROOT|NAME=value..."), its policies and store under `tmp`."""
    root, *extra = spec.split("|")
    command = [
        sys.executable, "-m", "proxy", "serve", "--port", str(port),
        "--upstream", f"{stub.base}/v1", "--policies", str(tmp / "policies"),
        "--store", f"sqlite:///{tmp}/{name}.db",
    ]  # fmt: skip
    env = {k: v for k, v in o.env().items() if k != "THREADKEEPER_WORKERS"}
    env.update(PYTHONPATH=root, THREADKEEPER_LOG_LEVEL="info")
    env.update(dict(pair.split("=", 1) for pair in extra))
    return root, command, env


def start(name: str, spec: str, stub: o.Server, tmp: Path) -> o.Server:
    port = o.free_port()
    root, command, env = serve_command(name, spec, stub, tmp, port)
    log = Path(tmp, f"{name}.log")
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=sink, cwd=root)
    server = o.Server(name, f"http://127.0.0.1:{port}", process)
    o.wait_ready(f"{server.base}/healthz", 60, process, log)
    return server


async def measure(
    servers: list[o.Server], requests: int, stream: bool, clients: int
) -> dict[str, tuple[float, list[float], float]]:
    body = o.encode(o.chat_body(stream=stream))
    make = o.first_byte if stream else o.post
    totals: dict[str, tuple[float, list[float], float]] = {}
    for server in servers:  # warm-up
        async with o.session(clients) as http:
            for _ in range(100):
                await make(server.base + "/v1/chat/completions", body)(http)
    rounds = 5
    for _ in range(rounds):
        for server in servers:
            request = make(server.base + "/v1/chat/completions", body)
            latencies: list[float] = []
            before = cpu_seconds(server.process.pid)
            async with o.session(clients) as http:
                began = time.perf_counter()
                each = requests // rounds // clients
                await asyncio.gather(
                    *(_client(request, http, each, latencies) for _ in range(clients))
                )
                wall = time.perf_counter() - began
            spent = cpu_seconds(server.process.pid) - before
            cpu, seen, seconds = totals.get(server.name, (0.0, [], 0.0))
            totals[server.name] = (cpu + spent, seen + latencies, seconds + wall)
    return totals


async def _client(
    request: o.Request, http: aiohttp.ClientSession, count: int, latencies: list[float]
) -> None:
    for _ in range(count):
        latency = await request(http)
        assert latency is not None
        latencies.append(latency)


Totals = dict[str, tuple[float, list[float], float]]  # name -> cpu, latencies, wall


def run_builds(roots: str, measure: Callable[[list[o.Server]], Awaitable[Totals]]) -> Totals:
    """The stub, the bare relay and one proxy per tree (comma-separated, each
    `root|NAME=value...`), measured together by `measure` and stopped after."""
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        (tmp / "policies").mkdir()
        (tmp / "policies" / "default.yaml").write_text(o.POLICY)
        stub = o.start_stub()
        servers = [stub]
        try:
            servers.append(o.start_bare(stub, tmp))
            for index, spec in enumerate(roots.split(",")):
                servers.append(start(f"tk{index}", spec, stub, tmp))
            return asyncio.run(measure(servers))
        finally:
            for server in servers:
                server.stop()


def report(totals: Totals) -> None:
    """Each target's CPU and p50 per request, and its added p50 against the hop's."""
    direct = statistics.median(totals["direct"][1])
    hop = statistics.median(totals["bare"][1]) - direct
    print(f"1-minute load average {os.getloadavg()[0]:.1f} at the end")
    for name, (cpu, latencies, wall) in totals.items():
        p50 = statistics.median(latencies)
        print(
            f"{name:7} cpu {cpu / len(latencies) * 1000:6.3f} ms/request  p50 {p50 * 1000:6.3f} ms"
            f"  added {(p50 - direct) * 1000:6.3f} ms ({(p50 - direct) / hop:5.2f}x the hop's)"
            f"  {len(latencies) / wall:5.0f} req/s  ({len(latencies)} requests)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("roots", help="comma-separated trees holding proxy/")
    parser.add_argument("--requests", type=int, default=2000, help="per target")
    parser.add_argument("--stream", action="store_true", help="time to first byte")
    parser.add_argument("--clients", type=int, default=1)
    args = parser.parse_args()
    report(
        run_builds(
            args.roots, lambda servers: measure(servers, args.requests, args.stream, args.clients)
        )
    )


if __name__ == "__main__":
    main()
