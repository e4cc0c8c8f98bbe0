"""Where the CPU of a stateful turn at 32 clients goes, by process, for 1 and 2 workers.

    python bench/turn_workers.py [--postgres DSN] [--seconds 8] [--clients 32] [--exact-stub]
                             [--stores sqlite,postgres] [--workers 1,2]

For each target (threadkeeper with 1 and 2 workers on SQLite, and on PostgreSQL when a
DSN is given) it seeds bench/overhead.py's 200-item conversations, gives each WARM_TURNS
turns (the proxy's CPU per turn over them is printed as "warm-up": it holds the turns on
windows a worker reads whole for the first time, once per conversation and worker), then
runs the 32-client Responses turns cell for `--seconds` and reports the turns a second
and the CPU time per turn (user + system, from /proc) of: the proxy's process tree, the
provider stub, this process (the bench's client), the PostgreSQL server's processes (all
of them: a shared server counts others' work too) and the whole machine (/proc/stat, all
cores), with the machine's busy share of its cores, and on PostgreSQL the database's
transactions per turn (pg_stat_database: a statement outside a transaction is one). A
second worker can only add turns a second while the machine has idle CPU left: when the
busy share is near 100% with one worker, the turn is bound by the machine, not by the
worker. The stub is bench/overhead.py's light one; `--exact-stub` gives the tests' stub,
which tokenizes each prompt (about as much CPU per turn as the proxy spends).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

import overhead as o
from chat_ab import cpu_seconds

WARM_TURNS = 2


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


def postgres_transactions(dsn: str | None) -> int:
    """Transactions committed and rolled back in `dsn`'s database so far (0 without one)."""
    if dsn is None:
        return 0
    import asyncpg

    async def read() -> int:
        connection = await asyncpg.connect(dsn)
        try:
            query = (
                "SELECT xact_commit + xact_rollback FROM pg_stat_database "
                "WHERE datname = current_database()"
            )
            await connection.execute("SELECT pg_stat_clear_snapshot()")
            return int(await connection.fetchval(query))
        finally:
            await connection.close()

    return asyncio.run(read())


def machine() -> tuple[float, float]:
    """(busy, total) CPU seconds of all cores since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(values) - idle) / tick, sum(values) / tick


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--postgres", help="also run on this PostgreSQL")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=o.MANY)
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
        try:
            stores = args.stores.split(",")
            counts = [int(n) for n in args.workers.split(",")]
            targets: list[tuple[str, int, str | None]] = []
            if "sqlite" in stores:
                targets += [("sqlite", workers, None) for workers in counts]
            if args.postgres and "postgres" in stores:
                for workers in counts:
                    targets.append(
                        ("postgres", workers, stack.enter_context(o.pg_schema(args.postgres)))
                    )
            for store_name, workers, url in targets:
                label = f"{store_name}-{workers}w"
                proxy = o.start_proxy(label, stub, tmp, workers=workers, store=url)
                try:
                    count = args.clients * 4
                    seeded = asyncio.run(o.seed_conversations(proxy.base, count))
                    # Two turns on every conversation before the cell: a worker's first turn
                    # on a window it never held reads it whole (the other worker seeded it),
                    # a cost once per conversation and worker, reported apart.
                    first = cpu_seconds(proxy.process.pid)
                    warm = asyncio.run(
                        o.conversation_turns(proxy.base, seeded, args.clients, 60, WARM_TURNS)
                    )
                    first = (cpu_seconds(proxy.process.pid) - first) / len(warm.latencies)
                    dsn = args.postgres if url is not None else None
                    time.sleep(1.5)  # idle backends report their statistics within 1 s
                    xacts = postgres_transactions(dsn)
                    before = (
                        cpu_seconds(proxy.process.pid),
                        cpu_seconds(stub.process.pid),
                        own_cpu(),
                        postgres_cpu(),
                        *machine(),
                    )
                    cell = asyncio.run(
                        o.conversation_turns(proxy.base, seeded, args.clients, args.seconds, 10)
                    )
                    after = (
                        cpu_seconds(proxy.process.pid),
                        cpu_seconds(stub.process.pid),
                        own_cpu(),
                        postgres_cpu(),
                        *machine(),
                    )
                    time.sleep(1.5)
                    xacts = postgres_transactions(dsn) - xacts
                finally:
                    proxy.stop()
                turns = len(cell.latencies)
                spent = [(b - a) / turns * 1000 for a, b in zip(before, after, strict=True)]
                busy = (after[4] - before[4]) / (after[5] - before[5])
                print(
                    f"{label:12} {turns / cell.seconds:6.1f} turns/s  p50 {cell.p50:7.1f} ms  "
                    f"cpu ms/turn: proxy {spent[0]:5.2f}  stub {spent[1]:5.2f}  "
                    f"client {spent[2]:5.2f}  postgres {spent[3]:5.2f}  machine {spent[4]:5.2f}  "
                    f"(busy {busy:4.0%} of the cores)  warm-up proxy {first * 1000:5.2f}"
                    + (f"  pg xacts/turn {xacts / turns:4.1f}" if dsn else "")
                )
                time.sleep(1)
        finally:
            stub.stop()


if __name__ == "__main__":
    main()
