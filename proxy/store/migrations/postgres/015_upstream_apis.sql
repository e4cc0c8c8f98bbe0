-- The API a tenant's upstream serves Responses turns through, learnt by policy
-- `upstream.api: auto` (proxy/server/chat_upstream.py): "chat" once the provider answered
-- /v1/responses with 404 or 405. Keyed by tenant and base URL, so a policy pointed at
-- another provider learns again; the first write wins.

CREATE TABLE upstream_apis (
    tenant     TEXT NOT NULL,
    base_url   TEXT NOT NULL,
    api        TEXT NOT NULL,
    learned_at TEXT NOT NULL,
    PRIMARY KEY (tenant, base_url)
);
