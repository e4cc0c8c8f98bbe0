-- Each item's content digest (proxy.core.items.content_digest: sha256 of its canonical
-- JSON, a form fixed across versions) is stored beside its token count, so loading a
-- thread never re-serializes or recounts its items. NULL (rows written before this
-- migration): computed when the row is loaded.

ALTER TABLE items ADD COLUMN digest TEXT;

-- Bumped whenever an item leaves the thread's log (a deleted conversation item), which the
-- version does not count: a process holding the window in memory reloads it whole then.
ALTER TABLE threads ADD COLUMN epoch BIGINT NOT NULL DEFAULT 0;
