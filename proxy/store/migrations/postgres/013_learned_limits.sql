-- What the providers taught about their models (proxy/server/learned.py), shared by every
-- replica and kept across restarts: per (tenant, upstream base URL, model), the window a
-- refusal stated or the provider lists, and the correction fitted from answers' usage
-- with the recent samples it rests on. `state` is JSON text (proxy/server/learned.py,
-- `to_state`), the same in both dialects; the last write wins.

CREATE TABLE learned_limits (
    tenant     TEXT NOT NULL,
    upstream   TEXT NOT NULL,
    model      TEXT NOT NULL,
    state      TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    PRIMARY KEY (tenant, upstream, model)
);
