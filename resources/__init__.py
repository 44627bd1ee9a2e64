"""Dagster resources: configured once here, injected into assets and ops.

One storage root for everything: env MILES_STORAGE_ROOT (default `.miles`, made absolute when the
code location loads), the `storage` resource.
"""

import os

from resources.storage import StorageRootResource


def default_resources() -> dict:
    root = os.environ.get("MILES_STORAGE_ROOT", ".miles")
    if "://" not in root:  # fixed when the code location loads: a run's working dir must not move it
        root = os.path.abspath(root)
    return {"storage": StorageRootResource(root=root)}
