-- Erasing a thread (Store.erase_thread, `threadkeeper threads delete --erase`) removes
-- everything derived from it, and stored responses are purged after the settings'
-- response_retention_seconds (Store.responses_purge).
--
-- Idempotency records name the thread their request ran on (NULL: a request on no
-- thread, and records written before this migration, which only their retention
-- removes). The indexes keep an erase and the purge off a scan of the whole table.

ALTER TABLE idempotency ADD COLUMN thread_id TEXT;

CREATE INDEX idempotency_by_thread ON idempotency (tenant, thread_id);
CREATE INDEX responses_by_thread ON responses (tenant, thread_id);
CREATE INDEX responses_by_age ON responses (created_at);
CREATE INDEX ledger_by_thread ON ledger (tenant, thread_id);
