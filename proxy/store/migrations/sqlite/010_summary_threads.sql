-- Summaries are thread data: deleting a thread deletes the summaries kept for it, and
-- the table does not grow without bound.
--
-- `summary_threads` names the threads a summary was kept for. Chunk digests are content
-- hashes, so threads of one tenant with the same history share a summary: it is deleted
-- with the last of them (`owned` = 1 once any thread was linked; a summary written for a
-- stateless request has no thread and is left to the retention). Summaries written before
-- this migration have no thread either.
--
-- `used_at` is when a process last served the summary (bumped in batches, not on every
-- read); summaries unused for the settings' summary_retention_seconds are purged.

CREATE TABLE summary_threads (
    tenant    TEXT NOT NULL,
    thread_id TEXT NOT NULL,
    model     TEXT NOT NULL,
    api       TEXT NOT NULL,
    digest    TEXT NOT NULL,
    PRIMARY KEY (tenant, thread_id, model, api, digest)
);

CREATE INDEX summary_threads_by_summary ON summary_threads (tenant, model, api, digest);

ALTER TABLE summaries ADD COLUMN owned INTEGER NOT NULL DEFAULT 0;
ALTER TABLE summaries ADD COLUMN used_at TEXT NOT NULL DEFAULT '';
UPDATE summaries SET used_at = created_at;

CREATE INDEX summaries_by_use ON summaries (used_at);
