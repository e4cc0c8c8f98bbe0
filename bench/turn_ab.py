"""Builds of the proxy in one run: the stateful Responses turn's CPU per turn and p50.

    python bench/turn_ab.py ROOT_A,ROOT_B[,...] [--turns 300] [--clients 1]

Each ROOT is a tree holding `proxy/` (a `git archive` of another commit, say), with
environment variables after "|" as bench/chat_ab.py takes them. The provider stub, the
bare relay (bench/bare_relay.py) and one `serve` per root (1 worker, SQLite) run as
separate processes. Each proxy gets conversations of bench/overhead.py's 200 items,
seeded before the clock starts; then, in five rounds, each target in turn takes its
share of turns (one new user message on a conversation, TURNS_PER_CONVERSATION turns
each), and direct and the bare relay the same 200 items statelessly. Reported per target:
the CPU time its process tree spent per request (user + system, from /proc: on a shared
machine steadier than latencies), the p50, the p50 added over direct and that as a
multiple of the bare relay's, and requests a second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import overhead as o
from chat_ab import cpu_seconds, report, run_builds

ROUNDS = 5


async def measure(
    servers: list[o.Server], turns: int, clients: int
) -> dict[str, tuple[float, list[float], float]]:
    stateless = o.encode(o.stateless_responses_body())
    per_round = turns // ROUNDS
    conversations: dict[str, list[str]] = {}
    for server in servers[2:]:
        count = -(-turns // o.TURNS_PER_CONVERSATION) + 1
        seeded = await o.seed_conversations(server.base, count)
        await o.conversation_turns(server.base, seeded[-1:], 1, 30)  # warm-up
        conversations[server.name] = seeded[:-1]
    for server in servers[:2]:  # warm-up
        async with o.session(clients) as http:
            for _ in range(20):
                await o.post(server.base + "/v1/responses", stateless)(http)
    totals: dict[str, tuple[float, list[float], float]] = {}
    for round_ in range(ROUNDS):
        for server in servers:
            before = cpu_seconds(server.process.pid)
            began = time.perf_counter()
            if server.name in conversations:
                share = per_round // o.TURNS_PER_CONVERSATION
                mine = conversations[server.name][round_ * share : (round_ + 1) * share]
                cell = await o.conversation_turns(server.base, mine, clients, 600)
                latencies = cell.latencies
            else:
                latencies = await _stateless(server, stateless, per_round, clients)
            wall = time.perf_counter() - began
            spent = cpu_seconds(server.process.pid) - before
            cpu, seen, seconds = totals.get(server.name, (0.0, [], 0.0))
            totals[server.name] = (cpu + spent, seen + latencies, seconds + wall)
    return totals


async def _stateless(server: o.Server, body: bytes, count: int, clients: int) -> list[float]:
    """`count` requests of the same 200 items, sent statelessly by `clients` clients."""
    request = o.post(server.base + "/v1/responses", body)
    latencies: list[float] = []
    async with o.session(clients) as http:

        async def client(each: int) -> None:
            for _ in range(each):
                latency = await request(http)
                assert latency is not None
                latencies.append(latency)

        await asyncio.gather(*(client(count // clients) for _ in range(clients)))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("roots", help="comma-separated trees holding proxy/")
    parser.add_argument("--turns", type=int, default=300, help="per target")
    parser.add_argument("--clients", type=int, default=1)
    args = parser.parse_args()
    print(f"1-minute load average {os.getloadavg()[0]:.1f} at the start")
    report(run_builds(args.roots, lambda servers: measure(servers, args.turns, args.clients)))


if __name__ == "__main__":
    main()
