-- Background responses (`background: true`, proxy/server/background.py). A response
-- knows whether it runs in the background (only those can be cancelled, and their count
-- per tenant is bounded), and a background stream's events are kept, numbered, so
-- `GET /v1/responses/{id}?stream=true&starting_after=N` replays them on any replica.

ALTER TABLE responses ADD COLUMN background INTEGER NOT NULL DEFAULT 0;

CREATE INDEX responses_background_running ON responses (tenant)
    WHERE background = 1 AND status = 'in_progress';

CREATE TABLE response_events (
    tenant      TEXT NOT NULL,
    response_id TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    event       TEXT,
    data        TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    PRIMARY KEY (tenant, response_id, seq)
);

CREATE INDEX response_events_by_age ON response_events (created_at);
