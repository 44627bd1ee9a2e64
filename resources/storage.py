"""Storage resources: the storage root (StoragePaths) and the DuckDB catalog over it."""

from typing import Any

import dagster as dg

from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths


class StorageRootResource(dg.ConfigurableResource):
    """Root of every artifact (local dir or fsspec URI); `.paths` names each path under it."""

    root: str = ".miles"

    @property
    def paths(self) -> StoragePaths:
        return StoragePaths(self.root)


class CatalogResource(dg.ConfigurableResource):
    """`<root>/catalog.duckdb`: views rollouts, policy_versions, evals, lineage, metrics."""

    root: str = ".miles"

    @property
    def catalog(self) -> Catalog:
        return Catalog(StoragePaths(self.root))

    def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        return self.catalog.query(sql)

    def refresh(self) -> bool:
        return self.catalog.refresh()
