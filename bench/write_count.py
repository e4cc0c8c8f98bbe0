"""Write transactions of one stateful turn on SQLite (issue 23, item 4).

    python bench/write_count.py [--turns 10]

In one process: the provider stub, threadkeeper on a SQLite file, and an aiohttp client.
A conversation is seeded with 200 items (as bench/overhead.py seeds them), then each of
`--turns` turns (one new user message, `POST /v1/responses` with `conversation`) is
counted: every `BEGIN IMMEDIATE` the store opens while the turn runs and until its
background writes (the explain record) have gone, with the code that opened it and the
statements inside it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from overhead import HEADERS, POLICY, seed_conversations, turn_body

from proxy.fake_provider import FakeProvider
from proxy.server.app import bound_port, create_app, start
from proxy.settings import Settings
from proxy.store import sqlite

ROOT = Path(__file__).resolve().parent.parent


class Counted:
    """Every write transaction: who opened it (the innermost proxy frame outside the
    store) and how many statements it ran."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, int]] = []

    def install(self) -> None:
        original = sqlite.SqliteDatabase.write
        writes = self.writes

        @asynccontextmanager
        async def write(db: Any, **kwargs: Any) -> AsyncIterator[Any]:
            where = opener(traceback.extract_stack())
            async with original(db, **kwargs) as conn:
                before = conn_statements(conn)
                yield conn
                writes.append((where, conn_statements(conn) - before))

        sqlite.SqliteDatabase.write = write  # type: ignore[method-assign]


def conn_statements(conn: Any) -> int:
    return int(getattr(conn, "_bench_statements", 0))


def count_statements() -> None:
    """Every statement a connection runs (fetchrow runs through fetch)."""
    for name in ("execute", "executemany", "fetch"):
        setattr(sqlite.SqliteConn, name, counting(getattr(sqlite.SqliteConn, name)))


def counting(method: Any) -> Any:
    async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._bench_statements = getattr(self, "_bench_statements", 0) + 1
        return await method(self, *args, **kwargs)

    return run


def opener(stack: traceback.StackSummary) -> str:
    for frame in reversed(stack):
        path = frame.filename
        if "/proxy/" in path and "/proxy/store/" not in path:
            return f"{path.split('/proxy/', 1)[1]}:{frame.lineno} {frame.name}"
    return "?"


def main(turns: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "policies").mkdir()
        Path(tmp, "policies", "default.yaml").write_text(POLICY)
        report(asyncio.run(counted_turns(Path(tmp), turns)))


async def counted_turns(tmp: Path, turns: int) -> list[list[tuple[str, int]]]:
    """The write transactions of each turn, after a 200-item conversation is seeded."""
    counted = Counted()
    counted.install()
    count_statements()
    provider = FakeProvider()
    settings = Settings(
        port=0,
        policies_dir=tmp / "policies",
        upstream_url=await provider.start(),
        store_url=f"sqlite:///{tmp}/tk.db",
    )
    runner = await start(settings, create_app(settings))
    base = f"http://127.0.0.1:{bound_port(runner)}"
    per_turn: list[list[tuple[str, int]]] = []
    try:
        (conversation,) = await seed_conversations(base, 1)
        await asyncio.sleep(0.5)  # the seed's background writes
        async with aiohttp.ClientSession() as http:
            for _ in range(turns):
                counted.writes.clear()
                body = turn_body(conversation)
                async with http.post(f"{base}/v1/responses", data=body, headers=HEADERS) as answer:
                    assert answer.status == 200, await answer.text()
                    await answer.read()
                await asyncio.sleep(0.3)  # the explain writer's batch
                per_turn.append(list(counted.writes))
    finally:
        await runner.cleanup()
        await provider.stop()
    return per_turn


def report(per_turn: list[list[tuple[str, int]]]) -> None:
    counts = collections.Counter(len(writes) for writes in per_turn)
    print(f"write transactions per turn (turns: count): {dict(sorted(counts.items()))}")
    kinds: collections.Counter[str] = collections.Counter()
    statements: collections.Counter[str] = collections.Counter()
    for writes in per_turn:
        for where, inside in writes:
            kinds[where] += 1
            statements[where] += inside
    print("opened by (per turn; statements inside each, besides its BEGIN and COMMIT):")
    for where, number in kinds.most_common():
        print(
            f"  {number / len(per_turn):4.1f}/turn  {statements[where] / number:5.1f} stmts  {where}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    main(args.turns)
