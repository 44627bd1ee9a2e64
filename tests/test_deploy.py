"""deploy/: the instance config passes Dagster's own validation, the run launcher config passes
K8sRunLauncher's schema, the training-op tags pass dagster-k8s' tag parser, and every manifest
names the same image and Postgres."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

from miles_platform.cluster.k8s import IMAGE, K8S_JOB_EXECUTOR_CONFIG, STORAGE_ROOT, TRAINING_OP_K8S_TAGS

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_instance_config_validates_with_dagster(tmp_path):
    from dagster._config import validate_config
    from dagster._core.instance.config import dagster_instance_config
    from dagster_k8s import K8sRunLauncher

    shutil.copy(DEPLOY / "dagster.yaml", tmp_path / "dagster.yaml")
    config, custom_class = dagster_instance_config(str(tmp_path))
    assert custom_class is None
    assert set(config["storage"]) == {"postgres"}
    launcher = config["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_k8s", "K8sRunLauncher")
    result = validate_config(K8sRunLauncher.config_type(), launcher["config"])
    assert result.success, result.errors
    assert launcher["config"]["job_image"] == IMAGE


def test_broken_instance_config_is_rejected(tmp_path):
    import pytest
    from dagster._core.errors import DagsterInvalidConfigError
    from dagster._core.instance.config import dagster_instance_config

    bad = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    bad["storage"]["postgres"]["postgres_db"]["prot"] = 5432  # typo'd key
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(DagsterInvalidConfigError):
        dagster_instance_config(str(tmp_path))


def test_training_op_tags_parse_as_gpu_request():
    from dagster_k8s.job import get_user_defined_k8s_config

    parsed = get_user_defined_k8s_config(TRAINING_OP_K8S_TAGS)
    requests = parsed.container_config["resources"]["requests"]
    assert int(requests["nvidia.com/gpu"]) >= 1
    assert json.loads(TRAINING_OP_K8S_TAGS["dagster-k8s/config"])["container_config"]["resources"]


def test_k8s_job_executor_opt_in_config_validates():
    from dagster import job, op
    from dagster._config import validate_config
    from dagster_k8s import k8s_job_executor

    result = validate_config(k8s_job_executor.config_schema.config_type, K8S_JOB_EXECUTOR_CONFIG)
    assert result.success, result.errors

    @op(tags=TRAINING_OP_K8S_TAGS)
    def rl_training():
        return None

    @job(executor_def=k8s_job_executor.configured(K8S_JOB_EXECUTOR_CONFIG))
    def training_job():
        rl_training()

    assert training_job.executor_def.name == "k8s"
    assert rl_training.tags == TRAINING_OP_K8S_TAGS


def test_manifests_share_image_and_storage():
    instance = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    ray = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    dockerfile = (DEPLOY / "Dockerfile").read_text()

    dep = values["dagster-user-deployments"]["deployments"][0]
    assert f"{dep['image']['repository']}:{dep['image']['tag']}" == IMAGE
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert ray["kind"] == "RayCluster" and ray["apiVersion"].startswith("ray.io/")
    pods = [ray["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in ray["spec"]["workerGroupSpecs"]
    ]
    assert {c["image"] for p in pods for c in p["spec"]["containers"]} == {IMAGE}
    assert re.search(rf"-t {re.escape(IMAGE)}\b", dockerfile)
    assert int(ray["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"]) >= 1

    pg = instance["storage"]["postgres"]["postgres_db"]
    assert pg["hostname"] == values["postgresql"]["postgresqlHost"]
    assert pg["username"] == values["postgresql"]["postgresqlUsername"]
    assert pg["db_name"] == values["postgresql"]["postgresqlDatabase"]
    assert values["global"]["postgresqlSecretName"] in instance["run_launcher"]["config"]["env_secrets"]

    storage_env = f"MILES_STORAGE_ROOT={STORAGE_ROOT}"
    assert storage_env in instance["run_launcher"]["config"]["env_vars"]
    assert storage_env in values["runLauncher"]["config"]["k8sRunLauncher"]["envVars"]
    for p in pods:
        env = {e["name"]: e["value"] for e in p["spec"]["containers"][0]["env"]}
        assert env["MILES_STORAGE_ROOT"] == STORAGE_ROOT
