"""Where the CPU of a stateful turn at 32 clients goes, by process, for 1 and 2 workers.

    python bench/turn_workers.py [--postgres DSN] [--seconds 8] [--clients 32] [--rounds 3]
                             [--warm-turns 2] [--exact-stub] [--stores sqlite,postgres] [--workers 1,2]

Every target (threadkeeper with 1 and 2 workers on SQLite, and on PostgreSQL when a DSN
is given) is started first, seeds 4 * `--clients` of bench/overhead.py's 200-item
conversations and gives each `--warm-turns` turns (the proxy's CPU per turn over them is
printed as "warm-up": it holds the turns on windows a worker reads whole for the first
time, once per conversation and worker). Then `--rounds` rounds, the targets in turn
(each round starting on the next), each cell ROUND_TURNS turns on every conversation by
`--clients` clients, so load that drifts hits every target alike. Each cell reports its
turns a second and the CPU time per turn (user + system, from /proc) of: the proxy's
process tree, the provider stub, this process (the bench's client), the PostgreSQL
server's processes (all of them: a shared server counts others' work too) and the whole
machine (/proc/stat, all cores), with the machine's busy share of its cores; the last
lines are each target's medians over the rounds. A second worker can only add turns a
second while the machine has idle CPU left: when the busy share is near 100% with one
worker, the turn is bound by the machine, not by the worker. The stub is
bench/overhead.py's light one; `--exact-stub` gives the tests' stub, which builds and
counts every item of every prompt (about as much CPU per turn as the proxy spends).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import overhead as o
from chat_ab import cpu_seconds

WARM_TURNS = 2
ROUND_TURNS = 2  # per conversation and round; 2 items a turn: 200 + 4 * (1 + rounds) at the end


def own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def postgres_cpu() -> float:
    pids = subprocess.run(["pgrep", "postgres"], capture_output=True, text=True).stdout.split()
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def machine() -> tuple[float, float]:
    """(busy, total) CPU seconds of all cores since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(values) - idle) / tick, sum(values) / tick


@dataclass
class Target:
    label: str
    proxy: o.Server
    seeded: list[str]
    warm_up: float  # the proxy's CPU seconds per warm-up turn


def cell_line(
    target: Target, stub: o.Server, clients: int, seconds: float
) -> tuple[str, float, float]:
    """One cell on `target`: each client takes ROUND_TURNS turns on each of its
    conversations (or stops at `seconds`); the line of figures, the turns a second and
    the proxy's CPU milliseconds per turn."""
    pid = target.proxy.process.pid
    before = (cpu_seconds(pid), cpu_seconds(stub.process.pid), own_cpu(), postgres_cpu())
    before_machine = machine()
    cell = asyncio.run(
        o.conversation_turns(target.proxy.base, target.seeded, clients, seconds, ROUND_TURNS)
    )
    after = (cpu_seconds(pid), cpu_seconds(stub.process.pid), own_cpu(), postgres_cpu())
    after_machine = machine()
    turns = len(cell.latencies)
    proxy, provider, client, database = (
        (b - a) / turns * 1000 for a, b in zip(before, after, strict=True)
    )
    whole = (after_machine[0] - before_machine[0]) / turns * 1000
    busy = (after_machine[0] - before_machine[0]) / (after_machine[1] - before_machine[1])
    line = (
        f"{target.label:12} {turns / cell.seconds:6.1f} turns/s  p50 {cell.p50:6.1f} ms  "
        f"cpu ms/turn: proxy {proxy:5.2f}  stub {provider:5.2f}  client {client:5.2f}  "
        f"postgres {database:5.2f}  machine {whole:5.2f}  (busy {busy:4.0%} of the cores)  "
        f"warm-up proxy {target.warm_up * 1000:5.2f}"
    )
    return line, turns / cell.seconds, proxy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--postgres", help="also run on this PostgreSQL")
    parser.add_argument("--seconds", type=float, default=8.0, help="at most, per cell")
    parser.add_argument("--clients", type=int, default=o.MANY)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm-turns", type=int, default=WARM_TURNS, help="per conversation")
    parser.add_argument("--exact-stub", action="store_true", help="the tests' stub")
    parser.add_argument("--stores", default="sqlite,postgres", help="comma-separated")
    parser.add_argument("--workers", default="1,2", help="the worker counts, comma-separated")
    args = parser.parse_args()
    print(f"1-minute load average {os.getloadavg()[0]:.1f} at the start, {os.cpu_count()} cores")
    stack = contextlib.ExitStack()
    with tempfile.TemporaryDirectory() as name, stack:
        tmp = Path(name)
        (tmp / "policies").mkdir()
        (tmp / "policies" / "default.yaml").write_text(o.POLICY)
        stub = o.start_stub(exact=args.exact_stub)
        stack.callback(stub.stop)
        stores = args.stores.split(",")
        counts = [int(n) for n in args.workers.split(",")]
        wanted: list[tuple[str, int, str | None]] = []
        if "sqlite" in stores:
            wanted += [("sqlite", workers, None) for workers in counts]
        if args.postgres and "postgres" in stores:
            for workers in counts:
                wanted.append(
                    ("postgres", workers, stack.enter_context(o.pg_schema(args.postgres)))
                )
        targets: list[Target] = []
        for store_name, workers, url in wanted:
            label = f"{store_name}-{workers}w"
            proxy = o.start_proxy(label, stub, tmp, workers=workers, store=url)
            stack.callback(proxy.stop)
            seeded = asyncio.run(o.seed_conversations(proxy.base, args.clients * 4))
            # WARM_TURNS turns on every conversation first: a worker's first turn on a
            # window it never held reads it whole (the other worker seeded it), a cost
            # once per conversation and worker, reported apart.
            spent = cpu_seconds(proxy.process.pid)
            warm = asyncio.run(
                o.conversation_turns(proxy.base, seeded, args.clients, 120, args.warm_turns)
            )
            spent = (cpu_seconds(proxy.process.pid) - spent) / len(warm.latencies)
            targets.append(Target(label, proxy, seeded, spent))
        figures: dict[str, list[tuple[float, float]]] = {t.label: [] for t in targets}
        for round_ in range(args.rounds):
            shift = round_ % len(targets)  # each round starts on another target
            for target in targets[shift:] + targets[:shift]:
                line, rate, proxy_ms = cell_line(target, stub, args.clients, args.seconds)
                figures[target.label].append((rate, proxy_ms))
                print(f"round {round_ + 1}  {line}", flush=True)
        for label, cells in figures.items():
            rate = statistics.median(r for r, _ in cells)
            proxy_ms = statistics.median(p for _, p in cells)
            print(f"median  {label:12} {rate:6.1f} turns/s  proxy {proxy_ms:5.2f} ms CPU a turn")


if __name__ == "__main__":
    main()
