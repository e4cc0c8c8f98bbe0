"""What a request left in the SQLite store: row count and a digest of every row, per table.

    before = snapshot(db_path)
    ... a request the proxy refused with a 4xx ...
    assert snapshot(db_path) == before, diff(before, snapshot(db_path))

Every table of the file is read (a table added by a later migration is covered without
editing this list) except the bookkeeping that changes on its own while the proxy idles:
`owners` holds each live process's heartbeat, `schema_version` only changes at startup.
Reads go through a read-only connection of their own, so they see what the proxy has
committed (WAL) and never take its write lock.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

# Tables whose rows change without any request: the owner heartbeat, the migration marker,
# and explain records, which a background writer stores after earlier requests ended (that
# a 4xx itself leaves no record is tests/server/test_explain_e2e.py's to check).
IGNORED_TABLES = frozenset({"owners", "schema_version", "explain_records"})


@dataclass(frozen=True)
class TableState:
    rows: int
    digest: str  # sha256 over every row, in a fixed order


StoreState = dict[str, TableState]


def sqlite_file(store_url: str) -> Path:
    """`sqlite:///path` (the form tests use) -> the database file."""
    prefix = "sqlite:///"
    if not store_url.startswith(prefix):
        raise ValueError(f"storecheck reads SQLite stores only, not {store_url!r}")
    return Path(store_url[len(prefix) :])


def snapshot(path: Path) -> StoreState:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        conn.text_factory = bytes  # rows are hashed as stored, surrogates and all
        tables = [
            str(name, "utf-8") if isinstance(name, bytes) else str(name)
            for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' "
                "AND name NOT LIKE 'sqlite_%' ORDER BY name"
            )
        ]
        state: StoreState = {}
        for table in tables:
            if table in IGNORED_TABLES:
                continue
            digest = hashlib.sha256()
            rows = 0
            # Every column, ordered by all of them: a stable order without knowing the keys.
            columns = [row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')]
            order = ", ".join(
                f'"{str(c, "utf-8") if isinstance(c, bytes) else c}"' for c in columns
            )
            for row in conn.execute(f'SELECT * FROM "{table}" ORDER BY {order}'):
                digest.update(repr(row).encode())
                digest.update(b"\n")
                rows += 1
            state[table] = TableState(rows, digest.hexdigest())
        return state
    finally:
        conn.close()


def settled_snapshot(path: Path, *, interval: float = 0.03, limit: float = 5.0) -> StoreState:
    """`snapshot` once two reads `interval` apart agree: an earlier request's answer may
    still be writing in a task of its own (the learned limits' `save_soon`), and what it
    writes belongs before the next request, not to it. After `limit` seconds it gives
    the last read, so no wait is unbounded."""
    deadline = time.monotonic() + limit
    state = snapshot(path)
    while time.monotonic() < deadline:
        time.sleep(interval)
        again = snapshot(path)
        if again == state:
            return state
        state = again
    return state


def diff(before: StoreState, after: StoreState) -> str:
    """Which tables changed, for an assertion message; empty when nothing did."""
    changed = []
    for table in sorted(set(before) | set(after)):
        old, new = before.get(table), after.get(table)
        if old != new:
            old_rows = old.rows if old else "-"
            new_rows = new.rows if new else "-"
            what = f"{old_rows} -> {new_rows} rows" if old_rows != new_rows else "rows rewritten"
            changed.append(f"{table}: {what}")
    return "; ".join(changed)
