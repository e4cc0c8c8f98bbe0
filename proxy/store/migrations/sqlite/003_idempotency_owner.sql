-- Request idempotency records name the process instance that runs them (SPEC section 8),
-- so a `running` record left by a process that died is released by the same dead-owner
-- sweep that ends its responses, instead of blocking its key (409) until it expires.
-- NULL (rows written before this migration): owner unknown, never swept, left to expire.

ALTER TABLE idempotency ADD COLUMN owner TEXT;

-- The sweep scans only the records still running.
CREATE INDEX idempotency_running ON idempotency (owner) WHERE status = 'running';
