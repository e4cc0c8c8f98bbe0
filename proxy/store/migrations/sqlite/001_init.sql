-- threadkeeper schema, SQLite dialect (SPEC sections 2, 7, 8).
-- Every table is keyed by tenant; JSON is stored as TEXT so raw items round-trip exactly.

CREATE TABLE threads (
    tenant           TEXT    NOT NULL,
    id               TEXT    NOT NULL,
    kind             TEXT    NOT NULL,
    metadata         TEXT    NOT NULL DEFAULT '{}',
    created_at       TEXT    NOT NULL,
    version          INTEGER NOT NULL DEFAULT 0,
    next_seq         INTEGER NOT NULL DEFAULT 0,
    state            TEXT    NOT NULL DEFAULT '{}',
    head_response_id TEXT,
    PRIMARY KEY (tenant, id)
);

-- The event log. The primary key (tenant, thread_id, seq) is the index load_window walks,
-- so reading a window costs the window, not the history.
CREATE TABLE items (
    tenant      TEXT    NOT NULL,
    thread_id   TEXT    NOT NULL,
    seq         INTEGER NOT NULL,
    item_id     TEXT    NOT NULL,
    raw         TEXT    NOT NULL,
    api         TEXT    NOT NULL,
    tokens      INTEGER NOT NULL DEFAULT 0,
    encoding    TEXT    NOT NULL DEFAULT '',
    response_id TEXT,
    role        TEXT    NOT NULL,
    created_at  TEXT    NOT NULL,
    PRIMARY KEY (tenant, thread_id, seq),
    UNIQUE (tenant, thread_id, item_id),
    FOREIGN KEY (tenant, thread_id) REFERENCES threads (tenant, id) ON DELETE CASCADE
);

CREATE TABLE responses (
    tenant               TEXT NOT NULL,
    id                   TEXT NOT NULL,
    thread_id            TEXT,
    previous_response_id TEXT,
    status               TEXT NOT NULL,
    request              TEXT NOT NULL DEFAULT '{}',
    response             TEXT,
    created_at           TEXT NOT NULL,
    owner                TEXT NOT NULL,
    input_first_seq      INTEGER,
    output_last_seq      INTEGER,
    PRIMARY KEY (tenant, id)
);

-- Crash recovery scans only the responses still running.
CREATE INDEX responses_in_progress ON responses (owner) WHERE status = 'in_progress';

-- Side-effect ledger (SPEC section 6): the primary key makes the first issue win.
CREATE TABLE ledger (
    tenant      TEXT    NOT NULL,
    scope       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    tool        TEXT    NOT NULL,
    call_id     TEXT    NOT NULL,
    thread_id   TEXT,
    response_id TEXT,
    status      TEXT    NOT NULL,
    arguments   TEXT    NOT NULL,
    result      TEXT,
    attempts    INTEGER NOT NULL DEFAULT 1,
    created_at  TEXT    NOT NULL,
    updated_at  TEXT    NOT NULL,
    PRIMARY KEY (tenant, scope, key)
);

CREATE INDEX ledger_call ON ledger (tenant, call_id);
CREATE INDEX ledger_status ON ledger (tenant, status, created_at);

-- Request idempotency (Idempotency-Key header).
CREATE TABLE idempotency (
    tenant           TEXT NOT NULL,
    key              TEXT NOT NULL,
    fingerprint      TEXT NOT NULL,
    status           TEXT NOT NULL,
    response_status  INTEGER,
    response_headers TEXT NOT NULL DEFAULT '[]',
    response_body    BLOB,
    created_at       TEXT NOT NULL,
    expires_at       TEXT NOT NULL,
    PRIMARY KEY (tenant, key)
);

CREATE INDEX idempotency_expiry ON idempotency (expires_at);
