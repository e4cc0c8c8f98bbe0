-- An explain record wrote five B-trees: the table, its primary key (tenant, request_id),
-- explain_records_by_id (request_id, migration 008), by age and by thread. The primary
-- key led by the request id serves both the tenant's lookup (Store.explain_get) and the
-- operators' by id alone, so explain_records_by_id goes. SQLite changes a table's
-- primary key only by building the table again (no other table refers to it).

DROP INDEX explain_records_by_id;
DROP INDEX explain_records_by_age;
DROP INDEX explain_records_by_thread;

CREATE TABLE explain_records_017 (
    tenant     TEXT NOT NULL,
    request_id TEXT NOT NULL,
    created_at TEXT NOT NULL,
    record     TEXT NOT NULL,
    thread_id  TEXT,
    PRIMARY KEY (request_id, tenant)
);

INSERT INTO explain_records_017 (tenant, request_id, created_at, record, thread_id)
SELECT tenant, request_id, created_at, record, thread_id FROM explain_records;

DROP TABLE explain_records;

ALTER TABLE explain_records_017 RENAME TO explain_records;

CREATE INDEX explain_records_by_age ON explain_records (created_at);
CREATE INDEX explain_records_by_thread ON explain_records (tenant, thread_id, created_at);
