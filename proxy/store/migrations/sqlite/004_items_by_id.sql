-- Responses `item_reference` inputs name an item by id alone, in any of the tenant's
-- threads (Store.find_item): this index keeps that lookup off a scan of the tenant's log.

CREATE INDEX items_by_id ON items (tenant, item_id);
