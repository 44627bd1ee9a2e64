"""Dagster resources: configured once here, injected into assets and ops."""

import os


def default_resources() -> dict:
    try:
        from resources.storage import CatalogResource, StorageRootResource
    except ModuleNotFoundError as e:
        if e.name != "resources.storage":
            raise
        return {}
    root = os.environ.get("MILES_STORAGE_ROOT", ".miles")
    return {"storage": StorageRootResource(root=root), "catalog": CatalogResource(root=root)}
