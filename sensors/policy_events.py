"""The walk both policy-version sensors share: new `policy_versions` materializations after a cursor."""

from collections.abc import Callable

import dagster as dg

from miles_platform.store.paths import parse_partition_key

POLICY_VERSIONS = dg.AssetKey("policy_versions")


def new_policy_versions(
    instance: dg.DagsterInstance,
    cursor: str | None,
    done: set[str],
    limit: int,
    accept: Callable[[str, dg.AssetMaterialization], bool] = lambda key, mat: True,
) -> tuple[list[str], str | None, int]:
    """Partition keys of materializations after `cursor` (a storage id), oldest first.

    Skips keys in `done`, repeats, keys that are not `<run>.v<NNNNNN>` and keys `accept` refuses.
    Returns (keys, new cursor, events looked at); the cursor stops right after the last event
    handled, so a walk that hits `limit` leaves the rest for the next tick.
    """
    after = int(cursor) if cursor else None
    keys: list[str] = []
    new_cursor, seen = cursor, 0
    while len(keys) < limit:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=POLICY_VERSIONS, after_storage_id=after),
            limit=100,
            ascending=True,
        ).records
        if not records:
            break
        for record in records:
            if len(keys) >= limit:
                break
            after, new_cursor, seen = record.storage_id, str(record.storage_id), seen + 1
            mat = record.asset_materialization
            key = mat.partition if mat is not None else None
            if not key or key in done or key in keys:
                continue
            try:
                parse_partition_key(key)
            except ValueError:
                continue
            if accept(key, mat):
                keys.append(key)
    return keys, new_cursor, seen
