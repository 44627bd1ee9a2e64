"""Dagster resources: configured once here, injected into assets and ops.

One storage root for everything: env MILES_STORAGE_ROOT (default `.miles`, made absolute when the
code location loads), shared by the `storage` and `catalog` resources.
"""

import os


def default_resources() -> dict:
    try:
        from resources.storage import CatalogResource, StorageRootResource
    except ModuleNotFoundError as e:
        if e.name != "resources.storage":
            raise
        return {}
    root = os.environ.get("MILES_STORAGE_ROOT", ".miles")
    if "://" not in root:  # fixed when the code location loads: a run's working dir must not move it
        root = os.path.abspath(root)
    return {"storage": StorageRootResource(root=root), "catalog": CatalogResource(root=root)}
