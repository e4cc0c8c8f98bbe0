-- Replica-safe crash recovery (SPEC sections 7, 8): every process instance heartbeats
-- here while it runs. A response left in_progress is orphaned only when its owner is dead:
-- silent for longer than the staleness limit, or (same host) its pid no longer exists.
-- A replica starting beside live ones therefore leaves their streams alone.
-- Times are fixed-width UTC ISO-8601 strings: string order is time order.

CREATE TABLE owners (
    owner        TEXT    NOT NULL PRIMARY KEY,
    host         TEXT    NOT NULL DEFAULT '',  -- machine + pid namespace; '' when unknown
    pid          INTEGER NOT NULL DEFAULT 0,
    started_at   TEXT    NOT NULL,
    heartbeat_at TEXT    NOT NULL
);
