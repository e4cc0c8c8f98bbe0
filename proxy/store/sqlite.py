"""The SQLite backend (SPEC section 8: the embedded default), WAL mode via aiosqlite.

A writer and a reader, each twice: an aiosqlite connection (its own thread) and one on
the event loop's thread. Writes in this process queue on an asyncio.Lock and run as
`BEGIN IMMEDIATE ... COMMIT`, so coroutines never meet "database is locked". A
transaction runs on the loop's connection when SQLite's lock is free (a turn's few
statements take tens of microseconds there; each trip to a thread and back costs about
as much, and far more on a busy machine); when another process holds the lock, that
connection's busy timeout of 0 sends the transaction to the thread, which waits on
`busy_timeout` while the loop serves. The loop's writer leaves WAL checkpoints (a file
write and sync) to a third aiosqlite connection: a PASSIVE one every CHECKPOINT_EVERY
commits. Migrations run in the thread. WAL lets readers take consistent snapshots while
a write is under way. An in-memory database cannot be shared between connections, so
there one aiosqlite connection writes and reads.

Waits are bounded (SPEC section 1, store timeouts): a coroutine waits at most
`lock_timeout` (store_connect_timeout, as a PostgreSQL pool's wait for a free connection)
for its turn on a connection, then each statement at most `busy_timeout`
(store_command_timeout) for another process's lock. So when another process holds the
database, every queued waiter gets StoreUnavailable within about their sum, not one
busy timeout after another.

Store failures that are the database's state, not a bug (disk full, I/O error, locked
longer than `busy_timeout`, queued longer than `lock_timeout`, read-only or unopenable
file) raise StoreUnavailable; the next statement tries again, so the store recovers when
the cause goes away.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from proxy.store import sql
from proxy.store.base import AlreadyExists, StoreUnavailable
from proxy.store.database import Row
from proxy.store.sqlstore import SqlStore

T = TypeVar("T")

MEMORY = ":memory:"
DEFAULT_BUSY_TIMEOUT = 10.0  # seconds; the store_command_timeout setting
DEFAULT_LOCK_TIMEOUT = 5.0  # seconds; the store_connect_timeout setting
_UNIQUE_ERRORS = {"SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY"}
_LOCKED_CODES = {5, 6}  # SQLITE_BUSY, SQLITE_LOCKED: another connection holds the lock
# The loop's writer never checkpoints the WAL itself (a checkpoint writes the database
# file and syncs it: milliseconds the loop would stall); every this many of its commits,
# a PASSIVE checkpoint runs on a connection of its own, in its thread.
CHECKPOINT_EVERY = 100
# The "BEGIN" of a block that runs one statement: none is sent, the statement is its own
# transaction (SQLite's autocommit), so neither BEGIN nor COMMIT costs a statement.
SINGLE = ""
# Primary result codes (extended code & 0xff) meaning "the database cannot serve now".
SQLITE_FULL = 13
_UNAVAILABLE_CODES = {
    5,  # SQLITE_BUSY: locked by another process past busy_timeout
    6,  # SQLITE_LOCKED
    7,  # SQLITE_NOMEM
    8,  # SQLITE_READONLY
    10,  # SQLITE_IOERR
    SQLITE_FULL,
    14,  # SQLITE_CANTOPEN
    15,  # SQLITE_PROTOCOL
}


def sqlite_path(url: str) -> str:
    """`sqlite:///rel/path` -> `rel/path`, `sqlite:////abs/path` -> `/abs/path`,
    `sqlite:///:memory:` -> `:memory:`."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix):
        raise ValueError(f"expected sqlite:///path or sqlite:///:memory:, got {url!r}")
    return url[len(prefix) :]


@lru_cache(maxsize=256)
def _qmark(query: str) -> str:
    return sql.to_qmark(query)


class SqliteConn:
    """Runs the shared `$n` statements on one aiosqlite connection, one trip to its thread
    each; a transaction's BEGIN rides with its first statement (`begin_with_next`).

    With `on_loop` (a second connection to the same file, opened on the event loop's
    thread), a transaction runs there instead, with no trip at all, when its BEGIN takes
    SQLite's lock at once: `on_loop`'s busy timeout is 0, so a lock held by another
    process is SQLITE_BUSY right away, and that transaction goes to the thread, whose
    connection waits out `busy_timeout` without holding up the loop."""

    def __init__(
        self, conn: aiosqlite.Connection, on_loop: sqlite3.Connection | None = None
    ) -> None:
        self._conn = conn
        self._on_loop = on_loop
        self._begin: str | None = None
        self._may_stay = False
        self._here = False  # the transaction under way runs on `on_loop`
        self.loop_commits = 0  # transactions committed on `on_loop`

    def begin_with_next(self, begin: str | None, *, on_loop: bool = True) -> None:
        """`begin` runs right before the next statement, in the same trip to the thread
        (each trip is a hand-off to the thread and back to the loop), or on the loop's
        connection if there is one and `on_loop`."""
        self._begin = begin
        self._here = False
        self._may_stay = on_loop and self._on_loop is not None

    @property
    def on_loop(self) -> bool:
        """Whether this connection has a twin on the loop's thread."""
        return self._on_loop is not None

    @property
    def begun(self) -> bool:
        """Whether the BEGIN asked for has run (no statement is waiting to carry it)."""
        return self._begin is None

    @property
    def here(self) -> bool:
        """Whether the transaction under way runs on the loop's connection."""
        return self._here

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`work` on the connection the transaction runs on (after the pending BEGIN;
        SINGLE: none, the statement is its own transaction). A unique key's violation
        is AlreadyExists."""
        try:
            return await self._run_there(work)
        except sqlite3.IntegrityError as error:
            if getattr(error, "sqlite_errorname", "") in _UNIQUE_ERRORS:
                raise AlreadyExists(str(error)) from error
            raise

    async def _run_there(self, work: Callable[[sqlite3.Connection], T]) -> T:
        begin, self._begin = self._begin, None
        if begin is not None and self._may_stay:
            assert self._on_loop is not None
            self._here = True
            try:
                return _begun_then(self._on_loop, begin, work)
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in _LOCKED_CODES:
                    raise
                _quietly_rolled_back(self._on_loop)
                self._here = False  # locked elsewhere: the thread waits for it
        if self._here:
            assert self._on_loop is not None
            return work(self._on_loop)
        conn = self._conn
        if begin is None:
            return await conn._execute(lambda: work(conn._conn))
        return await conn._execute(lambda: _begun_then(conn._conn, begin, work))

    async def execute(self, query: str, *args: Any) -> int:
        """The rows the statement changed, in one trip to the connection's thread (an
        aiosqlite cursor's close would be a second): the callers hold the connection's
        lock, so the change counter moves for this statement alone (the schema has no
        triggers, whose changes it would also count)."""
        statement = _qmark(query)

        def run(raw: sqlite3.Connection) -> int:
            before = raw.total_changes
            raw.execute(statement, args).fetchall()
            return raw.total_changes - before

        return await self._run(run)

    async def executemany(self, query: str, rows: Sequence[tuple[Any, ...]]) -> None:
        statement = _qmark(query)
        await self._run(lambda raw: raw.executemany(statement, rows).close())

    async def fetch(self, query: str, *args: Any) -> list[Row]:
        statement = _qmark(query)
        return await self._run(lambda raw: raw.execute(statement, args).fetchall())

    async def fetchrow(self, query: str, *args: Any) -> Row | None:
        rows = await self.fetch(query, *args)
        return rows[0] if rows else None


def _begun_then(raw: sqlite3.Connection, begin: str, work: Callable[[sqlite3.Connection], T]) -> T:
    if begin != SINGLE:
        raw.execute(begin)
    return work(raw)


def _quietly_rolled_back(raw: sqlite3.Connection) -> None:
    if raw.in_transaction:
        raw.execute("ROLLBACK")


class SqliteDatabase:
    dialect = "sqlite"

    def __init__(
        self,
        writer: aiosqlite.Connection,
        reader: aiosqlite.Connection | None,
        *,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        on_loop: tuple[sqlite3.Connection, sqlite3.Connection] | None = None,
        checkpointer: aiosqlite.Connection | None = None,
    ):
        """`on_loop`: a writer and a reader opened on the loop's thread (busy timeout 0),
        which transactions use when the lock is free (SqliteConn); `checkpointer`: the
        connection the loop's writer leaves the WAL's checkpoints to."""
        writes_here, reads_here = on_loop if on_loop is not None else (None, None)
        self._writer = SqliteConn(writer, writes_here)
        self._reader = SqliteConn(reader, reads_here) if reader is not None else self._writer
        self._connections = [c for c in (writer, reader, checkpointer) if c is not None]
        self._on_loop = [c for c in (writes_here, reads_here) if c is not None]
        self._checkpointer = checkpointer
        self._checkpoint: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        self._read_lock = asyncio.Lock() if reader is not None else self._write_lock
        self._lock_timeout = lock_timeout
        self.full_at: float | None = None

    def write(self, *, bounded: bool = True, single: bool = False) -> _Transaction:
        """`bounded=False` (migrations at start) waits for the queue without a limit; the
        busy timeout still bounds each statement. Such a write runs in the thread: a
        migration may build an index for minutes."""
        timeout = self._lock_timeout if bounded else None
        begin = SINGLE if single else "BEGIN IMMEDIATE"
        return _Transaction(self, self._writer, self._write_lock, timeout, begin, bounded)

    def read(self, *, single: bool = False) -> _Transaction:
        """`single`: one statement, which runs on the loop's writer when nothing holds or
        waits for it: that connection's page cache holds the pages it last wrote, while
        the reader's is emptied by every commit of another connection (SQLite's WAL)."""
        if single and self._writer.on_loop and not _taken(self._write_lock):
            return _Transaction(
                self, self._writer, self._write_lock, self._lock_timeout, SINGLE, True
            )
        begin = SINGLE if single else "BEGIN"
        return _Transaction(self, self._reader, self._read_lock, self._lock_timeout, begin, True)

    def _committed(self, conn: SqliteConn) -> None:
        if conn is self._writer and conn.loop_commits >= CHECKPOINT_EVERY:
            conn.loop_commits = 0
            self._checkpoint_soon()

    def _checkpoint_soon(self) -> None:
        """A PASSIVE checkpoint in the checkpointer's thread (it waits for no reader or
        writer); one at a time."""
        if self._checkpointer is None or (self._checkpoint and not self._checkpoint.done()):
            return
        self._checkpoint = asyncio.ensure_future(self._checkpointed(self._checkpointer))

    @staticmethod
    async def _checkpointed(checkpointer: aiosqlite.Connection) -> None:
        try:
            await checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error:  # busy or full: the next one tries again
            pass

    def _unavailable(self, exc: sqlite3.DatabaseError) -> StoreUnavailable | None:
        """The StoreUnavailable an error of the database's state is (None: another error)."""
        code = getattr(exc, "sqlite_errorcode", None)
        if code is None or code & 0xFF not in _UNAVAILABLE_CODES:
            return None
        if code & 0xFF == SQLITE_FULL:
            self.full_at = time.monotonic()
        name = getattr(exc, "sqlite_errorname", "")
        return StoreUnavailable(f"SQLite cannot serve now: {name} ({exc})")

    async def close(self) -> None:
        if self._checkpoint is not None:
            await self._checkpoint
        for connection in self._connections:
            await connection.close()
        for here in self._on_loop:
            here.close()


class _Transaction:
    """One transaction on `conn`, as one context manager (a turn runs three or four: one
    object each, not one per concern): this coroutine's turn on `lock`, waited for at
    most `limit` seconds; BEGIN sent with the first statement, COMMIT on a clean exit,
    ROLLBACK on any exception; SQLite's "cannot serve now" errors raised as
    StoreUnavailable.

    COMMIT sits inside the exit's try: a task cancelled while awaiting a statement or
    COMMIT has still queued it on the connection's thread, and the ROLLBACK queued behind
    keeps the connection out of a dangling transaction. Nothing to roll back or commit
    when no statement ran: the BEGIN was never sent. SINGLE: the one statement committed
    itself (a cancelled one in the thread may too)."""

    __slots__ = ("_begin", "_conn", "_db", "_limit", "_lock", "_on_loop")

    def __init__(
        self,
        db: SqliteDatabase,
        conn: SqliteConn,
        lock: asyncio.Lock,
        limit: float | None,
        begin: str,
        on_loop: bool,
    ) -> None:
        self._db = db
        self._conn = conn
        self._lock = lock
        self._limit = limit
        self._begin = begin
        self._on_loop = on_loop

    async def __aenter__(self) -> SqliteConn:
        await _turn_on(self._lock, self._limit)
        self._conn.begin_with_next(self._begin, on_loop=self._on_loop)
        return self._conn

    async def __aexit__(self, kind: Any, error: BaseException | None, trace: Any) -> None:
        conn, transaction = self._conn, self._begin != SINGLE
        try:
            try:
                if error is not None:
                    if conn.begun and transaction:
                        await _rollback(conn)
                elif conn.begun:  # else no statement ran: nothing began
                    if transaction:
                        await conn.execute("COMMIT")
                    conn.loop_commits += conn.here
            except BaseException:
                if error is None and conn.begun and transaction:
                    await _rollback(conn)
                raise
            finally:
                conn.begin_with_next(None)
                self._lock.release()
        except sqlite3.DatabaseError as exc:
            unavailable = self._db._unavailable(exc)
            if unavailable is None:
                raise
            raise unavailable from exc
        if isinstance(error, sqlite3.DatabaseError):
            unavailable = self._db._unavailable(error)
            if unavailable is not None:
                raise unavailable from error
        elif error is None:
            self._db._committed(conn)


def _taken(lock: asyncio.Lock) -> bool:
    """Whether `lock` is held or waited for (asyncio keeps its waiters in `_waiters`:
    None or empty when there are none)."""
    return lock.locked() or bool(getattr(lock, "_waiters", True))


async def _turn_on(lock: asyncio.Lock, limit: float | None) -> None:
    """This coroutine's turn on a connection, waited for at most `limit` seconds (a free
    lock nobody waits for is taken at once: no timer is set)."""
    try:
        if _taken(lock):
            async with asyncio.timeout(limit):
                await lock.acquire()
        else:
            await lock.acquire()
    except TimeoutError:
        raise StoreUnavailable(
            f"SQLite is busy: no connection was free within {limit:g}s (store_connect_timeout)"
        ) from None


async def _rollback(conn: SqliteConn) -> None:
    try:
        await conn.execute("ROLLBACK")
    except sqlite3.OperationalError:  # no transaction was active (BEGIN failed or COMMIT ran)
        pass


async def _connect(path: str, busy_timeout: float) -> aiosqlite.Connection:
    # isolation_level=None: we issue BEGIN/COMMIT ourselves (sqlite3's implicit ones would
    # not cover SELECTs or DDL).
    conn = await aiosqlite.connect(path, isolation_level=None)
    conn.row_factory = sqlite3.Row
    for pragma in (
        # First: the next pragmas (WAL recovery after a crash) may wait on other processes.
        f"PRAGMA busy_timeout={round(busy_timeout * 1000)}",
        "PRAGMA journal_mode=WAL",
        "PRAGMA synchronous=NORMAL",  # durable across process crashes in WAL mode
        "PRAGMA foreign_keys=ON",
    ):
        await conn.execute(pragma)
    return conn


def _connect_on_loop(path: str) -> sqlite3.Connection:
    """A connection for the loop's own thread: busy timeout 0 (a lock held elsewhere is
    SQLITE_BUSY at once, and the transaction goes to the thread) and no checkpoints of
    its own (wal_autocheckpoint=0: the checkpointer's)."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=0)
    conn.row_factory = sqlite3.Row
    for pragma in ("PRAGMA synchronous=NORMAL", "PRAGMA foreign_keys=ON"):
        conn.execute(pragma)
    conn.execute("PRAGMA wal_autocheckpoint=0")
    return conn


async def open_sqlite_store(
    url: str,
    *,
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> SqlStore:
    """`busy_timeout`: how long a statement waits for another process's lock;
    `lock_timeout`: how long a transaction waits for this process's connection."""
    path = sqlite_path(url)
    if path != MEMORY and not Path(path).parent.is_dir():
        # Checked here: a failed aiosqlite connect leaves its thread behind.
        raise ValueError(f"the directory of {path!r} does not exist")
    writer = await _connect(path, busy_timeout)
    if path == MEMORY:  # one connection: nothing else can open the same database
        return SqlStore(SqliteDatabase(writer, None, lock_timeout=lock_timeout))
    reader = await _connect(path, busy_timeout)
    checkpointer = await _connect(path, busy_timeout)
    on_loop = (_connect_on_loop(path), _connect_on_loop(path))
    database = SqliteDatabase(
        writer, reader, lock_timeout=lock_timeout, on_loop=on_loop, checkpointer=checkpointer
    )
    return SqlStore(database)
