-- Summaries an LLM wrote (proxy/summarizer.py), one per run of history items (a chunk),
-- keyed by the chunk's digest and the summarizer model: a stateless client that resends
-- its history, or a stateful thread that reaches a cut computed ahead, gets the summary
-- already paid for. `raw` is the summary item as sent (the same bytes every time);
-- `state` the structured memory state it was rendered from (proxy/core/memory.py).
-- The primary key makes the first write win.

CREATE TABLE summaries (
    tenant     TEXT NOT NULL,
    model      TEXT NOT NULL,
    api        TEXT NOT NULL,
    digest     TEXT NOT NULL,
    raw        TEXT NOT NULL,
    state      TEXT,
    created_at TEXT NOT NULL,
    PRIMARY KEY (tenant, model, api, digest)
);
