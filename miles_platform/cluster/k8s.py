"""Kubernetes constants shared by the Dagster layer and the manifests under deploy/.

No dagster import here (the engine stays Dagster-free): these are plain dicts that the op author
attaches, e.g. `@op(tags=TRAINING_OP_K8S_TAGS)`. Under `k8s_job_executor` each step runs in its own
pod and these tags size the training step's pod; under the default executor they size the run pod.
"""

from __future__ import annotations

import json

IMAGE = "ghcr.io/miles-platform/miles-platform:0.1.0"  # the image deploy/Dockerfile builds
NAMESPACE = "miles"
POSTGRES_SECRET = "dagster-postgresql-secret"  # key: postgresql-password (the Dagster chart's name)
STORAGE_ROOT = "s3://miles-platform/storage"  # MILES_STORAGE_ROOT in every pod

GPUS_PER_TRAINING_POD = 8
# Ray client address of the KubeRay head service (deploy/kuberay/raycluster.yaml) for runs that
# pass `--ray-address` instead of starting Ray inside the training pod.
KUBERAY_CLIENT_ADDRESS = "ray://miles-ray-head-svc.miles.svc.cluster.local:10001"

# `dagster-k8s/config` for the rl_training op: one GPU node's worth for the step pod, which starts
# a local Ray (no --ray-address) and places trainer + engines on its GPUs. With --ray-address
# KUBERAY_CLIENT_ADDRESS the work runs on the KubeRay workers and the step pod needs no GPU.
TRAINING_OP_K8S_CONFIG: dict = {
    "container_config": {
        "resources": {
            "requests": {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": str(GPUS_PER_TRAINING_POD)},
            "limits": {"memory": "256Gi", "nvidia.com/gpu": str(GPUS_PER_TRAINING_POD)},
        },
        "env": [{"name": "MILES_STORAGE_ROOT", "value": STORAGE_ROOT}],
    },
    "pod_spec_config": {
        "node_selector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}

# Op tags take string values: the JSON-encoded config, as dagster-k8s reads it.
TRAINING_OP_K8S_TAGS: dict[str, str] = {"dagster-k8s/config": json.dumps(TRAINING_OP_K8S_CONFIG)}

# Opt-in for per-step pods: `@job(executor_def=k8s_job_executor.configured(K8S_JOB_EXECUTOR_CONFIG))`
# (or `Definitions(executor=...)` for every asset job). Each op then runs in its own k8s Job; the
# training op's TRAINING_OP_K8S_TAGS override the step defaults below for its pod only.
K8S_JOB_EXECUTOR_CONFIG: dict = {
    "job_namespace": NAMESPACE,
    "max_concurrent": 4,
    "image_pull_policy": "IfNotPresent",
    "env_secrets": [POSTGRES_SECRET],
    "step_k8s_config": {"container_config": {"resources": {"requests": {"cpu": "1", "memory": "4Gi"}}}},
}
