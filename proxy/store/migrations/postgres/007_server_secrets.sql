-- Secrets the proxy creates once and every replica shares, by name (today "compaction":
-- the key of threadkeeper's compaction items, proxy/core/compaction.py). The primary key
-- makes the first write win, so replicas that start together agree on one value.
-- `value` is base64 text, the same in both dialects.

CREATE TABLE server_secrets (
    name       TEXT PRIMARY KEY,
    value      TEXT NOT NULL,
    created_at TEXT NOT NULL
);
