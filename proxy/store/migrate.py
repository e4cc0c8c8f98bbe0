"""One migration mechanism for both dialects.

Migrations are numbered SQL files, one list per dialect, in
`proxy/store/migrations/<dialect>/NNN_name.sql`. `migrate(db)` applies the pending ones in
order, in ONE transaction, and records each in `schema_version`. On PostgreSQL the
transaction first takes `pg_advisory_xact_lock`, so replicas that start together apply
each migration once and the others wait, then see nothing left to do. On SQLite the
transaction is `BEGIN IMMEDIATE`, which already excludes every other writer.

Example::

    applied = await migrate(db)   # -> [1] on a fresh database, [] afterwards
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

from proxy.clock import utc_now
from proxy.store.database import Database

CREATE_SCHEMA_VERSION = """
CREATE TABLE IF NOT EXISTS schema_version (
    version    INTEGER PRIMARY KEY,
    name       TEXT NOT NULL,
    applied_at TEXT NOT NULL
)
"""

SELECT_VERSIONS = "SELECT version FROM schema_version ORDER BY version"
RECORD_VERSION = "INSERT INTO schema_version (version, name, applied_at) VALUES ($1, $2, $3)"

# The lock is per schema, so test schemas (and tenants of one cluster) do not queue up.
PG_MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(hashtext('threadkeeper.migrate:' || coalesce(current_schema(), '')))"

_FILE_NAME = re.compile(r"^(\d+)_(\w+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def statements(self) -> list[str]:
        return split_statements(self.sql)


def split_statements(sql: str) -> list[str]:
    """Statements of a migration file. SQLite's executescript would COMMIT mid-transaction,
    so both dialects run statement by statement (files hold no `;` inside literals)."""
    lines = [line.split("--", 1)[0] for line in sql.splitlines()]
    return [stmt.strip() for stmt in "\n".join(lines).split(";") if stmt.strip()]


def load_migrations(dialect: str) -> list[Migration]:
    folder = resources.files("proxy.store").joinpath("migrations", dialect)
    found = []
    for entry in folder.iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda migration: migration.version)
    versions = [migration.version for migration in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration numbers in migrations/{dialect}: {versions}")
    return found


def pending(migrations: list[Migration], applied: set[int]) -> list[Migration]:
    return [migration for migration in migrations if migration.version not in applied]


async def migrate(db: Database) -> list[int]:
    """Apply pending migrations; returns the versions this call applied."""
    migrations = load_migrations(db.dialect)
    async with db.write(bounded=False) as conn:  # a long migration is not an outage
        if db.dialect == "postgres":
            await conn.execute(PG_MIGRATION_LOCK)
        await conn.execute(CREATE_SCHEMA_VERSION)
        applied = {row["version"] for row in await conn.fetch(SELECT_VERSIONS)}
        todo = pending(migrations, applied)
        for migration in todo:
            for statement in migration.statements:
                await conn.execute(statement)
            await conn.execute(RECORD_VERSION, migration.version, migration.name, utc_now())
    return [migration.version for migration in todo]


async def schema_versions(db: Database) -> list[int]:
    async with db.read() as conn:
        return [row["version"] for row in await conn.fetch(SELECT_VERSIONS)]
