"""SQL text shared by the SQLite and PostgreSQL stores (the rows it reads and writes are
decoded where they are run: proxy/store/sqlstore.py).

Nothing here runs a cursor. Statements are written once with PostgreSQL's `$n`
placeholders; `to_qmark` rewrites them to SQLite's numbered `?n` form, so both backends
run the same text (both support `ON CONFLICT` and `RETURNING`).
"""

from __future__ import annotations

import re

_PLACEHOLDER = re.compile(r"\$(\d+)")


def to_qmark(sql: str) -> str:
    """`$1` -> `?1`: SQLite's numbered parameters bind the same positions as asyncpg's."""
    return _PLACEHOLDER.sub(r"?\1", sql)


# threads -------------------------------------------------------------------------------

THREAD_COLUMNS = (
    "tenant, id, kind, metadata, created_at, version, next_seq, state, head_response_id, epoch"
)

INSERT_THREAD = f"""
INSERT INTO threads (tenant, id, kind, metadata, created_at, version, next_seq, state)
VALUES ($1, $2, $3, $4, $5, 0, $6, $7)
ON CONFLICT (tenant, id) DO NOTHING
RETURNING {THREAD_COLUMNS}
"""

SELECT_THREAD = f"SELECT {THREAD_COLUMNS} FROM threads WHERE tenant = $1 AND id = $2"

# Operator listings (the threads CLI): newest first.
LIST_THREADS = f"SELECT {THREAD_COLUMNS} FROM threads ORDER BY created_at DESC, tenant, id LIMIT $1"
LIST_TENANT_THREADS = f"""
SELECT {THREAD_COLUMNS} FROM threads WHERE tenant = $1 ORDER BY created_at DESC, id LIMIT $2
"""
# substr, not LIKE: a tenant id may hold "_", LIKE's wildcard.
LIST_CALLER_THREADS = f"""
SELECT {THREAD_COLUMNS} FROM threads WHERE tenant = $1 OR substr(tenant, 1, $2) = $3
ORDER BY created_at DESC, tenant, id LIMIT $4
"""
# The namespaces of a tenant and its passthrough callers that hold a thread or a response.
TENANT_NAMESPACES = """
SELECT tenant FROM threads WHERE tenant = $1 OR substr(tenant, 1, $2) = $3
UNION
SELECT tenant FROM responses WHERE tenant = $1 OR substr(tenant, 1, $2) = $3
ORDER BY tenant LIMIT $4
"""
FIND_THREADS = f"SELECT {THREAD_COLUMNS} FROM threads WHERE id = $1 ORDER BY tenant LIMIT $2"

UPDATE_METADATA = f"""
UPDATE threads SET metadata = $3 WHERE tenant = $1 AND id = $2 RETURNING {THREAD_COLUMNS}
"""

DELETE_THREAD = "DELETE FROM threads WHERE tenant = $1 AND id = $2"
DELETE_THREAD_ITEMS = "DELETE FROM items WHERE tenant = $1 AND thread_id = $2"

# The OCC write (SPEC section 7): one conditional UPDATE claims a seq range and bumps the
# version. Without a version guard appends still serialize on the row and commute.
_ADVANCE_THREAD = f"""
UPDATE threads
SET version = version + 1,
    next_seq = next_seq + $3,
    state = COALESCE($4, state),
    head_response_id = COALESCE($5, head_response_id)
WHERE tenant = $1 AND id = $2{{guard}}
RETURNING {THREAD_COLUMNS}
"""
ADVANCE_THREAD = _ADVANCE_THREAD.format(guard="")
ADVANCE_THREAD_AT_VERSION = _ADVANCE_THREAD.format(guard=" AND version = $6")

# items ---------------------------------------------------------------------------------

ITEM_COLUMNS = "seq, item_id, raw, api, tokens, encoding, response_id, role, created_at, digest"

INSERT_ITEM = """
INSERT INTO items (tenant, thread_id, seq, item_id, raw, api, tokens, encoding, response_id,
    role, created_at, digest)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
"""

COPY_ITEMS = """
INSERT INTO items (tenant, thread_id, seq, item_id, raw, api, tokens, encoding, response_id,
    role, created_at, digest)
SELECT tenant, $3, seq, item_id, raw, api, tokens, encoding, response_id, role, created_at,
    digest
FROM items WHERE tenant = $1 AND thread_id = $2 AND seq <= $4
"""

SELECT_ITEMS_FROM = f"""
SELECT {ITEM_COLUMNS} FROM items WHERE tenant = $1 AND thread_id = $2 AND seq >= $3 ORDER BY seq
"""

SELECT_ITEMS_BETWEEN = f"""
SELECT {ITEM_COLUMNS} FROM items
WHERE tenant = $1 AND thread_id = $2 AND seq >= $3 AND seq <= $4 ORDER BY seq
"""

SELECT_ITEM = (
    f"SELECT {ITEM_COLUMNS} FROM items WHERE tenant = $1 AND thread_id = $2 AND item_id = $3"
)

# This and SELECT_ITEM, DELETE_ITEM: the unique key (tenant, item_id, thread_id), migration 016.
FIND_ITEM = f"SELECT {ITEM_COLUMNS} FROM items WHERE tenant = $1 AND item_id = $2 LIMIT 1"

DELETE_ITEM = "DELETE FROM items WHERE tenant = $1 AND thread_id = $2 AND item_id = $3"
# An item left the log: the epoch tells window caches to read it whole, the version makes a
# turn committing what it read before (its cut may quote the item) lose the race.
BUMP_EPOCH = (
    "UPDATE threads SET epoch = epoch + 1, version = version + 1 WHERE tenant = $1 AND id = $2"
)
SELECT_STATE = "SELECT state FROM threads WHERE tenant = $1 AND id = $2"
SET_STATE = "UPDATE threads SET state = $3 WHERE tenant = $1 AND id = $2"


def page_query(order: str, *, after: bool) -> str:
    """One page of a thread's items; `$3` is the cursor's seq when `after` is set."""
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
    cursor = (" AND seq > $3" if order == "asc" else " AND seq < $3") if after else ""
    limit = "$4" if after else "$3"
    return (
        f"SELECT {ITEM_COLUMNS} FROM items WHERE tenant = $1 AND thread_id = $2{cursor} "
        f"ORDER BY seq {order.upper()} LIMIT {limit}"
    )


# responses -----------------------------------------------------------------------------

RESPONSE_COLUMNS = (
    "tenant, id, thread_id, previous_response_id, status, request, response, created_at, "
    "owner, input_first_seq, output_last_seq, background"
)

INSERT_RESPONSE = f"""
INSERT INTO responses ({RESPONSE_COLUMNS})
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
ON CONFLICT (tenant, id) DO NOTHING
"""

SELECT_RESPONSE = f"SELECT {RESPONSE_COLUMNS} FROM responses WHERE tenant = $1 AND id = $2"
FIND_RESPONSES = f"SELECT {RESPONSE_COLUMNS} FROM responses WHERE id = $1 ORDER BY tenant LIMIT $2"

COMPLETE_TURN_RESPONSE = """
UPDATE responses
SET status = 'completed', response = COALESCE($3, response),
    input_first_seq = $4, output_last_seq = $5
WHERE tenant = $1 AND id = $2 AND status <> 'cancelled'
"""

FINISH_RESPONSE = """
UPDATE responses SET status = $3, response = COALESCE($4, response)
WHERE tenant = $1 AND id = $2 AND status <> 'cancelled'
"""

# A cancelled response stays cancelled: the completion or failure that lost the race to a
# cancel changes nothing (the conditional UPDATEs above), and learns why from this.
RESPONSE_STATUS = "SELECT status FROM responses WHERE tenant = $1 AND id = $2"

# background responses (migration 014) ---------------------------------------------------

# The one transition a cancel makes, and only from a running background response: of a
# cancel and a completion racing, the first UPDATE wins and the other matches no row.
CANCEL_RESPONSE = """
UPDATE responses SET status = 'cancelled'
WHERE tenant = $1 AND id = $2 AND background AND status = 'in_progress'
"""

COUNT_BACKGROUND_RUNNING = """
SELECT count(*) AS running FROM responses
WHERE tenant = $1 AND background AND status = 'in_progress'
"""

# Held to the end of the transaction that counts and inserts a background response
# (PostgreSQL only): begin_response's check of background.max_running is then atomic.
LOCK_BACKGROUND_TENANT = "SELECT pg_advisory_xact_lock(hashtext('threadkeeper.background:' || $1))"

INSERT_RESPONSE_EVENT = """
INSERT INTO response_events (tenant, response_id, seq, event, data, created_at)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (tenant, response_id, seq) DO NOTHING
"""

SELECT_RESPONSE_EVENTS = """
SELECT seq, event, data FROM response_events
WHERE tenant = $1 AND response_id = $2 AND seq > $3 ORDER BY seq LIMIT $4
"""

LAST_RESPONSE_EVENT = """
SELECT max(seq) AS last FROM response_events WHERE tenant = $1 AND response_id = $2
"""

DELETE_RESPONSE_EVENTS = "DELETE FROM response_events WHERE tenant = $1 AND response_id = $2"

PURGE_RESPONSE_EVENTS = "DELETE FROM response_events WHERE created_at < $1"

DELETE_RESPONSE = "DELETE FROM responses WHERE tenant = $1 AND id = $2"

# Recovery runs across tenants: it is the process, not a tenant, that died.
ABANDON_ALL = "UPDATE responses SET status = 'incomplete' WHERE status = 'in_progress'"
ABANDON_OWNED = ABANDON_ALL + " AND owner = $1"

# owners (SPEC section 8): a response is orphaned only when its owner stopped heartbeating.
HEARTBEAT_COLUMNS = "owner, host, pid, started_at, heartbeat_at"

HEARTBEAT = f"""
INSERT INTO owners ({HEARTBEAT_COLUMNS}) VALUES ($1, $2, $3, $4, $4)
ON CONFLICT (owner) DO UPDATE SET heartbeat_at = excluded.heartbeat_at
"""

SELECT_HEARTBEATS = f"SELECT {HEARTBEAT_COLUMNS} FROM owners ORDER BY started_at, owner"

ABANDON_DEAD = (
    ABANDON_ALL
    + """ AND owner <> $2 AND NOT EXISTS (
    SELECT 1 FROM owners WHERE owners.owner = responses.owner AND owners.heartbeat_at >= $1
)"""
)

DELETE_STALE_OWNERS = "DELETE FROM owners WHERE heartbeat_at < $1 AND owner <> $2"

DELETE_OWNER = "DELETE FROM owners WHERE owner = $1"

# A running idempotency record of a dead owner would block its key (409) until it expires.
# A NULL owner (unknown) never matches `<>` or `=`, so such a record is left to expire.
DELETE_OWNED_IDEMPOTENCY = "DELETE FROM idempotency WHERE status = 'running' AND owner = $1"

DELETE_DEAD_IDEMPOTENCY = """
DELETE FROM idempotency WHERE status = 'running' AND owner <> $2 AND NOT EXISTS (
    SELECT 1 FROM owners WHERE owners.owner = idempotency.owner AND owners.heartbeat_at >= $1
)"""

# server secrets (migration 007): the first write of a name wins ------------------------

INSERT_SECRET = """
INSERT INTO server_secrets (name, value, created_at) VALUES ($1, $2, $3)
ON CONFLICT (name) DO NOTHING
"""

SELECT_SECRET = "SELECT value FROM server_secrets WHERE name = $1"

# learned limits (migration 013): the last write wins -----------------------------------

UPSERT_LEARNED = """
INSERT INTO learned_limits (tenant, upstream, model, state, updated_at) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (tenant, upstream, model) DO UPDATE SET state = excluded.state,
    updated_at = excluded.updated_at
"""

LEARNED_COLUMNS = "tenant, upstream, model, state, updated_at"

SELECT_LEARNED = f"""
SELECT {LEARNED_COLUMNS} FROM learned_limits WHERE tenant = $1 AND upstream = $2 AND model = $3
"""

LIST_LEARNED = f"""
SELECT {LEARNED_COLUMNS} FROM learned_limits WHERE tenant = $1
ORDER BY upstream, model LIMIT $2
"""

LIST_ALL_LEARNED = f"""
SELECT {LEARNED_COLUMNS} FROM learned_limits ORDER BY tenant, upstream, model LIMIT $1
"""


# upstream APIs (migration 015): the first write wins -----------------------------------

INSERT_UPSTREAM_API = """
INSERT INTO upstream_apis (tenant, base_url, api, learned_at) VALUES ($1, $2, $3, $4)
ON CONFLICT (tenant, base_url) DO NOTHING
"""

SELECT_UPSTREAM_API = "SELECT api FROM upstream_apis WHERE tenant = $1 AND base_url = $2"

# ledger --------------------------------------------------------------------------------

LEDGER_COLUMNS = (
    "tenant, scope, key, tool, call_id, thread_id, response_id, status, arguments, result, "
    "attempts, created_at, updated_at"
)

INSERT_LEDGER = f"""
INSERT INTO ledger ({LEDGER_COLUMNS})
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
ON CONFLICT (tenant, scope, key) DO NOTHING
RETURNING {LEDGER_COLUMNS}
"""

SELECT_LEDGER = f"SELECT {LEDGER_COLUMNS} FROM ledger WHERE tenant = $1 AND scope = $2 AND key = $3"

SELECT_LEDGER_BY_CALL = f"""
SELECT {LEDGER_COLUMNS} FROM ledger WHERE tenant = $1 AND call_id = $2
ORDER BY created_at DESC, scope DESC, key DESC LIMIT 1
"""

RESOLVE_LEDGER = """
UPDATE ledger SET status = $4, result = $5, updated_at = $6
WHERE tenant = $1 AND scope = $2 AND key = $3 AND status = $7
"""

# A failed entry goes back to issued for a new call (SPEC 6, ledger.decide FAILED_BEFORE):
# the status condition makes one of two racing re-arms win.
REARM_LEDGER = """
UPDATE ledger SET status = 'issued', call_id = $4, result = NULL, attempts = attempts + 1,
    updated_at = $5
WHERE tenant = $1 AND scope = $2 AND key = $3 AND status = 'failed'
"""

LIST_LEDGER = f"SELECT {LEDGER_COLUMNS} FROM ledger WHERE tenant = $1 ORDER BY created_at, scope, key LIMIT $2"

LIST_ALL_LEDGER = (
    f"SELECT {LEDGER_COLUMNS} FROM ledger ORDER BY created_at, tenant, scope, key LIMIT $1"
)

LIST_ALL_LEDGER_BY_STATUS = f"""
SELECT {LEDGER_COLUMNS} FROM ledger WHERE status = $1 ORDER BY created_at, tenant, scope, key LIMIT $2
"""

LIST_CALLER_LEDGER = f"""
SELECT {LEDGER_COLUMNS} FROM ledger WHERE tenant = $1 OR substr(tenant, 1, $2) = $3
ORDER BY created_at, tenant, scope, key LIMIT $4
"""

LIST_CALLER_LEDGER_BY_STATUS = f"""
SELECT {LEDGER_COLUMNS} FROM ledger
WHERE (tenant = $1 OR substr(tenant, 1, $2) = $3) AND status = $4
ORDER BY created_at, tenant, scope, key LIMIT $5
"""

LIST_LEDGER_BY_STATUS = f"""
SELECT {LEDGER_COLUMNS} FROM ledger WHERE tenant = $1 AND status = $2 ORDER BY created_at, scope, key LIMIT $3
"""

# request idempotency -------------------------------------------------------------------

IDEMPOTENCY_COLUMNS = (
    "tenant, key, fingerprint, status, response_status, response_headers, response_body, "
    "created_at, expires_at, owner"
)

# First write wins, except over an expired record (ISO-8601 UTC strings order like time).
BEGIN_IDEMPOTENCY = f"""
INSERT INTO idempotency ({IDEMPOTENCY_COLUMNS})
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (tenant, key) DO UPDATE SET
    fingerprint = excluded.fingerprint, status = excluded.status,
    response_status = excluded.response_status, response_headers = excluded.response_headers,
    response_body = excluded.response_body, created_at = excluded.created_at,
    expires_at = excluded.expires_at, owner = excluded.owner
WHERE idempotency.expires_at < excluded.created_at
RETURNING key
"""

SELECT_IDEMPOTENCY = f"SELECT {IDEMPOTENCY_COLUMNS} FROM idempotency WHERE tenant = $1 AND key = $2"

FINISH_IDEMPOTENCY = """
UPDATE idempotency
SET status = 'done', response_status = $3, response_headers = $4, response_body = $5,
    thread_id = $6
WHERE tenant = $1 AND key = $2
"""

ABORT_IDEMPOTENCY = "DELETE FROM idempotency WHERE tenant = $1 AND key = $2 AND status = 'running'"

PURGE_IDEMPOTENCY = "DELETE FROM idempotency WHERE expires_at < $1"

# LLM summaries -------------------------------------------------------------------------

SUMMARY_COLUMNS = "tenant, model, api, digest, raw, state, created_at"

# A new summary was last used when it was written.
INSERT_SUMMARY = f"""
INSERT INTO summaries ({SUMMARY_COLUMNS}, used_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $7)
ON CONFLICT (tenant, model, api, digest) DO NOTHING
RETURNING digest
"""

# The thread a summary is kept for must exist when the link is written. On PostgreSQL the
# row is share-locked: a delete_thread running meanwhile either waits for this link (and
# deletes it) or has deleted the thread first (and this finds none). SQLite's writers
# run one at a time.
_THREAD_EXISTS = "SELECT 1 AS found FROM threads WHERE tenant = $1 AND id = $2"
THREAD_EXISTS = {"sqlite": _THREAD_EXISTS, "postgres": _THREAD_EXISTS + " FOR SHARE"}


def keep_summaries(count: int) -> str:
    """Links the stored summaries among `count` digests ($5...) to thread $2."""
    digests = ", ".join(f"${n}" for n in range(5, 5 + count))
    return (
        "INSERT INTO summary_threads (tenant, thread_id, model, api, digest) "
        "SELECT tenant, $2, model, api, digest FROM summaries "
        f"WHERE tenant = $1 AND model = $3 AND api = $4 AND digest IN ({digests}) "
        "ON CONFLICT (tenant, thread_id, model, api, digest) DO NOTHING"
    )


def own_summaries(count: int) -> str:
    """Marks the summaries of `count` digests ($4...) as kept for a thread once."""
    digests = ", ".join(f"${n}" for n in range(4, 4 + count))
    return (
        "UPDATE summaries SET owned = 1 "
        f"WHERE tenant = $1 AND model = $2 AND api = $3 AND digest IN ({digests}) AND owned = 0"
    )


TOUCH_SUMMARY = """
UPDATE summaries SET used_at = $5
WHERE tenant = $1 AND model = $2 AND api = $3 AND digest = $4 AND used_at < $5
"""

_SAME_SUMMARY = (
    "link.tenant = summaries.tenant AND link.model = summaries.model "
    "AND link.api = summaries.api AND link.digest = summaries.digest"
)

# delete_thread: the summaries this thread alone kept, then its links.
DELETE_THREAD_SUMMARIES = f"""
DELETE FROM summaries
WHERE (tenant, model, api, digest) IN (
    SELECT tenant, model, api, digest FROM summary_threads WHERE tenant = $1 AND thread_id = $2
)
AND NOT EXISTS (
    SELECT 1 FROM summary_threads link WHERE {_SAME_SUMMARY} AND link.thread_id <> $2
)
"""
DELETE_THREAD_LINKS = "DELETE FROM summary_threads WHERE tenant = $1 AND thread_id = $2"

# The retention: summaries unused since $1 and their links. Then the summaries whose
# threads are all gone (two of them deleted at once each saw the other's link).
PURGE_SUMMARY_LINKS = """
DELETE FROM summary_threads WHERE (tenant, model, api, digest) IN (
    SELECT tenant, model, api, digest FROM summaries WHERE used_at < $1
)
"""
PURGE_SUMMARIES = "DELETE FROM summaries WHERE used_at < $1"
PURGE_ORPHAN_SUMMARIES = f"""
DELETE FROM summaries WHERE owned = 1
AND NOT EXISTS (SELECT 1 FROM summary_threads link WHERE {_SAME_SUMMARY})
"""


def select_summaries(count: int) -> str:
    """The summaries of `count` digests ($4...): one placeholder each, which both
    dialects bind (SQLite has no arrays)."""
    digests = ", ".join(f"${n}" for n in range(4, 4 + count))
    return (
        f"SELECT {SUMMARY_COLUMNS} FROM summaries "
        f"WHERE tenant = $1 AND model = $2 AND api = $3 AND digest IN ({digests})"
    )


# explain records -------------------------------------------------------------------------

INSERT_EXPLAIN = """
INSERT INTO explain_records (tenant, request_id, created_at, record, thread_id)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (tenant, request_id) DO NOTHING
"""
SELECT_EXPLAIN = """
SELECT tenant, request_id, created_at, record FROM explain_records
WHERE tenant = $1 AND request_id = $2
"""
FIND_EXPLAIN = """
SELECT tenant, request_id, created_at, record FROM explain_records
WHERE request_id = $1 ORDER BY tenant LIMIT 2
"""
THREAD_EXPLAIN = """
SELECT tenant, request_id, created_at, record FROM explain_records
WHERE tenant = $1 AND thread_id = $2 ORDER BY created_at DESC, request_id DESC LIMIT $3
"""
PURGE_EXPLAIN = "DELETE FROM explain_records WHERE created_at < $1"
DELETE_THREAD_EXPLAIN = "DELETE FROM explain_records WHERE tenant = $1 AND thread_id = $2"

# inspector sessions --------------------------------------------------------------------

SESSION_COLUMNS = "id_hash, tenant, key_hash, signing_key, created_at, expires_at"
INSERT_SESSION = (
    f"INSERT INTO inspector_sessions ({SESSION_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)"
)
SELECT_SESSION = f"SELECT {SESSION_COLUMNS} FROM inspector_sessions WHERE id_hash = $1"
DELETE_SESSION = "DELETE FROM inspector_sessions WHERE id_hash = $1"
PURGE_SESSIONS = "DELETE FROM inspector_sessions WHERE expires_at <= $1"
PURGE_SESSIONS_OF_OTHER_KEYS = (
    "DELETE FROM inspector_sessions WHERE expires_at <= $1 OR signing_key <> $2"
)

# erasing a thread and the responses retention (migration 012) --------------------------

# Everything derived from thread $2 of tenant $1, each table by its own column (indexed).
ERASE_THREAD = {
    "response_events": (
        "DELETE FROM response_events WHERE tenant = $1 AND response_id IN "
        "(SELECT id FROM responses WHERE tenant = $1 AND thread_id = $2)"
    ),
    "responses": "DELETE FROM responses WHERE tenant = $1 AND thread_id = $2",
    "idempotency": "DELETE FROM idempotency WHERE tenant = $1 AND thread_id = $2",
    "ledger": (
        "DELETE FROM ledger WHERE tenant = $1 AND (thread_id = $2 OR scope = 'thread:' || $2)"
    ),
    "explain_records": DELETE_THREAD_EXPLAIN,
}

# The oldest finished responses created before $1, at most $2 of them (one bounded
# transaction); the threads they were on come back for the chains they leave empty.
PURGE_RESPONSES = """
DELETE FROM responses WHERE (tenant, id) IN (
    SELECT tenant, id FROM responses
    WHERE created_at < $1 AND status <> 'in_progress' ORDER BY created_at LIMIT $2
)
RETURNING tenant, thread_id
"""

# A response chain (kind "responses") is reached only through its responses: with none
# left it can never be continued, and it goes with the last of them.
EMPTY_CHAIN = """
SELECT 1 AS found FROM threads WHERE tenant = $1 AND id = $2 AND kind = 'responses'
AND NOT EXISTS (SELECT 1 FROM responses WHERE tenant = $1 AND thread_id = $2)
"""
