-- Signed-in inspector browsers (proxy/server/inspector.py). The cookie carries a random
-- session id; the row, keyed by its sha256 (a reader of the store cannot sign in with
-- it), is what makes the session valid: sign-out deletes it, and a proxy started with
-- another operator token deletes the rows of the old one (`signing_key`). Shared by
-- every worker and replica of the store.

CREATE TABLE inspector_sessions (
    id_hash     TEXT PRIMARY KEY,
    tenant      TEXT,
    key_hash    TEXT,
    signing_key TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    expires_at  TEXT NOT NULL
);

CREATE INDEX inspector_sessions_by_expiry ON inspector_sessions (expires_at);
