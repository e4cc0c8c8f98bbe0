-- A turn's items wrote four B-trees each: the table, its primary key, the unique key
-- (tenant, thread_id, item_id) and items_by_id (tenant, item_id, migration 004). One
-- unique key led by the item id serves both the thread's lookups (Store.get_item,
-- delete_item, list_items' cursor) and the tenant's (Store.find_item), and keeps ids
-- unique within a thread. SQLite drops a table's unique key only by building the table
-- again (no other table refers to items).

DROP INDEX items_by_id;

CREATE TABLE items_016 (
    tenant      TEXT    NOT NULL,
    thread_id   TEXT    NOT NULL,
    seq         INTEGER NOT NULL,
    item_id     TEXT    NOT NULL,
    raw         TEXT    NOT NULL,
    api         TEXT    NOT NULL,
    tokens      INTEGER NOT NULL DEFAULT 0,
    encoding    TEXT    NOT NULL DEFAULT '',
    response_id TEXT,
    role        TEXT    NOT NULL,
    created_at  TEXT    NOT NULL,
    digest      TEXT,
    PRIMARY KEY (tenant, thread_id, seq),
    UNIQUE (tenant, item_id, thread_id),
    FOREIGN KEY (tenant, thread_id) REFERENCES threads (tenant, id) ON DELETE CASCADE
);

INSERT INTO items_016 (tenant, thread_id, seq, item_id, raw, api, tokens, encoding,
    response_id, role, created_at, digest)
SELECT tenant, thread_id, seq, item_id, raw, api, tokens, encoding, response_id, role,
    created_at, digest
FROM items ORDER BY tenant, thread_id, seq;

DROP TABLE items;

ALTER TABLE items_016 RENAME TO items;
