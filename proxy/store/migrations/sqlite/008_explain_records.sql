-- Explain records (GET /threadkeeper/v1/requests/{request_id}): what one model request
-- sent and why, kept for the settings' explain_retention_seconds and purged in the
-- background. Request ids are random, so the CLI finds one by id alone.

CREATE TABLE explain_records (
    tenant     TEXT NOT NULL,
    request_id TEXT NOT NULL,
    created_at TEXT NOT NULL,
    record     TEXT NOT NULL,
    PRIMARY KEY (tenant, request_id)
);

CREATE INDEX explain_records_by_id ON explain_records (request_id);
CREATE INDEX explain_records_by_age ON explain_records (created_at);
