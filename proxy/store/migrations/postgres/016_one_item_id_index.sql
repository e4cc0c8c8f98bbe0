-- A turn's items wrote three indexes each: the primary key, the unique key
-- (tenant, thread_id, item_id) and items_by_id (tenant, item_id, migration 004). One
-- unique key led by the item id serves both the thread's lookups (Store.get_item,
-- delete_item, list_items' cursor) and the tenant's (Store.find_item), and keeps ids
-- unique within a thread.

ALTER TABLE items ADD CONSTRAINT items_tenant_item_id_thread_id_key
    UNIQUE (tenant, item_id, thread_id);

ALTER TABLE items DROP CONSTRAINT items_tenant_thread_id_item_id_key;

DROP INDEX items_by_id;
