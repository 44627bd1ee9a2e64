"""The storage resource: the storage root (StoragePaths) every asset, op and sensor writes and reads
under. The DuckDB catalog over it is opened where it is queried (`Catalog(resource.paths)`)."""

import dagster as dg

from miles_platform.store.paths import StoragePaths


class StorageRootResource(dg.ConfigurableResource):
    """Root of every artifact (local dir or fsspec URI); `.paths` names each path under it."""

    root: str = ".miles"

    @property
    def paths(self) -> StoragePaths:
        return StoragePaths(self.root)
