"""Scale-out: Ray init/join and placement (ray_cluster), rollout-data handoff (object_store),
Kubernetes constants for the Dagster layer (k8s). Import the submodules; nothing heavy here."""
