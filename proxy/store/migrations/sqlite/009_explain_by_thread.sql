-- The inspector's thread page links the thread's recent requests: explain records name
-- their thread in a column of their own (NULL for a request on no thread, and for
-- records written before this migration).

ALTER TABLE explain_records ADD COLUMN thread_id TEXT;

CREATE INDEX explain_records_by_thread ON explain_records (tenant, thread_id, created_at);
