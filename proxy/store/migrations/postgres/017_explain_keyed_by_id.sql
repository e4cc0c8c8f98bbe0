-- An explain record wrote four indexes: its primary key (tenant, request_id),
-- explain_records_by_id (request_id, migration 008), by age and by thread. The primary
-- key led by the request id serves both the tenant's lookup (Store.explain_get) and the
-- operators' by id alone, so explain_records_by_id goes.

ALTER TABLE explain_records DROP CONSTRAINT explain_records_pkey;

ALTER TABLE explain_records ADD PRIMARY KEY (request_id, tenant);

DROP INDEX explain_records_by_id;
