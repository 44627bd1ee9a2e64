"""Kubernetes constants shared by the Dagster layer and the manifests under deploy/.

No dagster import here (the engine stays Dagster-free): these are plain dicts that the op author
attaches, e.g. `@op(tags=TRAINING_OP_K8S_TAGS)`. Under `k8s_job_executor` each step runs in its own
pod and these tags size the training step's pod; under the default executor they size the run pod.

`ray_cluster_spec` is the KubeRay cluster both deploy/kuberay manifests carry (the long-lived
RayCluster and each per-run RayJob's `rayClusterSpec`); `rayjob_manifest` builds a per-run RayJob.
"""

from __future__ import annotations

import hashlib
import json
import re

IMAGE = "ghcr.io/miles-platform/miles-platform:0.1.0"  # the image deploy/Dockerfile builds
NAMESPACE = "miles"
POSTGRES_SECRET = "dagster-postgresql-secret"  # key: postgresql-password (the Dagster chart's name)
# Ray token auth in the cluster: one Secret, two keys of the same token: `auth_token` (what
# KubeRay's `authOptions.secretName` reads and sets on every Ray container) and `RAY_AUTH_TOKEN`
# (the Dagster pods, which get the Secret as env vars and join with RAY_AUTH_MODE=token):
#   T=$(openssl rand -hex 32); kubectl create secret generic miles-ray-auth -n miles \
#     --from-literal=auth_token=$T --from-literal=RAY_AUTH_TOKEN=$T
RAY_AUTH_SECRET = "miles-ray-auth"
RAY_AUTH_ENV = "RAY_AUTH_MODE=token"  # Dagster's env_vars form
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
        "env": [
            {"name": "MILES_STORAGE_ROOT", "value": STORAGE_ROOT},
            {"name": "RAY_AUTH_MODE", "value": "token"},  # its own Ray, or KubeRay's: token auth
            {
                "name": "RAY_AUTH_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": RAY_AUTH_SECRET, "key": "auth_token"}},
            },
        ],
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
    "env_secrets": [POSTGRES_SECRET, RAY_AUTH_SECRET],
    "env_vars": [RAY_AUTH_ENV],
    "step_k8s_config": {"container_config": {"resources": {"requests": {"cpu": "1", "memory": "4Gi"}}}},
}


# --- KubeRay (deploy/kuberay/) ---
RAY_VERSION = "2.60.0"  # the ray[default] pin in pyproject.toml: KubeRay's `rayVersion`
# KubeRay's MaxRayJobNameLength: the RayCluster it creates is `<name>-<5 chars>` and a RayCluster
# name may have 53 (its Services append suffixes within the 63 of a DNS label).
RAYJOB_NAME_MAX_LEN = 47
MOONCAKE_MASTER = "miles-mooncake-master.miles.svc.cluster.local:50051"
_RAY_ENV = [{"name": "MILES_STORAGE_ROOT", "value": STORAGE_ROOT}]  # token auth: authOptions below


def _head_group(image: str) -> dict:
    return {
        "serviceType": "ClusterIP",
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},  # nothing scheduled on the head
        "template": {"spec": {"containers": [{
            "name": "ray-head",
            "image": image,
            "env": list(_RAY_ENV),
            "ports": [
                {"containerPort": 6379, "name": "gcs"},
                {"containerPort": 8265, "name": "dashboard"},
                {"containerPort": 10001, "name": "client"},
            ],
            "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}},
        }]}},
    }  # fmt: skip


def _gpu_worker_group(image: str, replicas: int, min_replicas: int, max_replicas: int) -> dict:
    gpus = str(GPUS_PER_TRAINING_POD)
    return {
        "groupName": "gpu",
        "replicas": replicas,
        "minReplicas": min_replicas,
        "maxReplicas": max_replicas,
        "rayStartParams": {"num-gpus": gpus},
        "template": {"spec": {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{
                "name": "ray-worker",
                "image": image,
                "env": [*_RAY_ENV, {"name": "MOONCAKE_PROTOCOL", "value": "tcp"},
                        {"name": "MOONCAKE_MASTER", "value": MOONCAKE_MASTER}],
                "resources": {
                    "requests": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": gpus},
                    "limits": {"memory": "512Gi", "nvidia.com/gpu": gpus},
                },
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}],
        }},
    }  # fmt: skip


def ray_cluster_spec(image: str = IMAGE, *, replicas: int, min_replicas: int, max_replicas: int) -> dict:
    """A RayCluster `spec`: CPU-only head (ports 6379/8265/10001), one group of 8-GPU workers, Ray's
    token auth from RAY_AUTH_SECRET."""
    if not 0 <= min_replicas <= replicas <= max_replicas:
        raise ValueError(
            f"worker replicas: need 0 <= min_replicas ({min_replicas}) <= replicas ({replicas}) "
            f"<= max_replicas ({max_replicas})"
        )
    return {
        "rayVersion": RAY_VERSION,
        # Ray's token auth (KubeRay >= 1.5.1): every Ray container gets RAY_AUTH_MODE=token and the
        # token of RAY_AUTH_SECRET (key auth_token); a RayJob's submitter too
        "authOptions": {"mode": "token", "secretName": RAY_AUTH_SECRET},
        "headGroupSpec": _head_group(image),
        "workerGroupSpecs": [_gpu_worker_group(image, replicas, min_replicas, max_replicas)],
    }


def rayjob_name(run_name: str) -> str:
    """The RayJob name for a run: a DNS-1035 label of at most 47 characters, as KubeRay requires.

    A run name that already is one is kept. Otherwise it is lowercased, each run of other characters
    becomes `-`, `run-` goes in front of a leading digit, it is cut to fit, and 8 hex digits of the
    run name's sha256 go at the end, so that e.g. `Demo_1` and `demo.1` get different RayJobs.
    """
    if re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", run_name) and len(run_name) <= RAYJOB_NAME_MAX_LEN:
        return run_name
    base = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")
    if not base:
        raise ValueError(
            f"run name {run_name!r}: no letter or digit to build a Kubernetes name from; "
            "pass --run-name with letters, digits and '-'"
        )
    if base[0].isdigit():
        base = f"run-{base}"
    digest = hashlib.sha256(run_name.encode()).hexdigest()[:8]
    return f"{base[: RAYJOB_NAME_MAX_LEN - len(digest) - 1].rstrip('-')}-{digest}"


def rayjob_manifest(
    run_name: str,
    entrypoint: str,
    *,
    namespace: str = NAMESPACE,
    image: str = IMAGE,
    num_gpu_workers: int = 1,
    ttl_seconds: int = 600,
    active_deadline_seconds: int = 24 * 3600,
) -> dict:
    """A KubeRay RayJob (ray.io/v1) that runs `entrypoint` on a Ray cluster of its own.

    KubeRay creates the cluster, submits `entrypoint` as a Ray job once it is up (the driver joins
    through the RAY_ADDRESS the job gets, so no --ray-address), and deletes the cluster
    `ttl_seconds` after the job ends; `active_deadline_seconds` fails a job that runs longer.
    K8sJobMode: the submitter is a k8s Job that follows the driver's logs, so `kubectl logs
    job/<name>` keeps them after the cluster is gone (HTTPMode has no such pod).
    """
    if num_gpu_workers < 1:
        raise ValueError(f"num_gpu_workers={num_gpu_workers}: a run needs at least one GPU worker")
    if ttl_seconds < 0 or active_deadline_seconds <= 0:
        raise ValueError(
            f"ttl_seconds={ttl_seconds}, active_deadline_seconds={active_deadline_seconds}: "
            "KubeRay needs ttl_seconds >= 0 and active_deadline_seconds > 0"
        )
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": rayjob_name(run_name), "namespace": namespace},
        "spec": {
            "entrypoint": entrypoint,
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": ttl_seconds,
            "activeDeadlineSeconds": active_deadline_seconds,
            # fixed size: no autoscaler, every worker the run's placement needs from the start
            "rayClusterSpec": ray_cluster_spec(
                image, replicas=num_gpu_workers, min_replicas=num_gpu_workers, max_replicas=num_gpu_workers
            ),
        },
    }
