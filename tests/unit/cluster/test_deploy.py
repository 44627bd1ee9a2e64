"""deploy/: the instance config passes Dagster's own validation, the run launcher config passes
K8sRunLauncher's schema, the training-op tags pass dagster-k8s' tag parser, the KubeRay manifests
(and `rayjob_manifest`) pass KubeRay's own CRD schemas (deploy/kuberay/crds/), and every manifest
names the same image and Postgres."""

from __future__ import annotations

import copy
import functools
import gzip
import importlib.metadata
import json
import re
import shlex
import shutil
from pathlib import Path

import jsonschema
import pytest
import yaml

from miles_platform.cluster.k8s import (
    GPUS_PER_TRAINING_POD,
    IMAGE,
    K8S_JOB_EXECUTOR_CONFIG,
    RAY_AUTH_SECRET,
    RAY_VERSION,
    RAYJOB_NAME_MAX_LEN,
    STORAGE_ROOT,
    TRAINING_OP_K8S_CONFIG,
    TRAINING_OP_K8S_TAGS,
    ray_cluster_spec,
    rayjob_manifest,
    rayjob_name,
)
from miles_platform.config import parse_run_config

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
KUBERAY = DEPLOY / "kuberay"


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


def test_the_training_job_carries_the_gpu_tags_in_a_pod_only(monkeypatch):
    from ops.training import _k8s_tags, rl_training

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert _k8s_tags() == {} and "dagster-k8s/config" not in rl_training.tags  # a local instance
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert _k8s_tags() == TRAINING_OP_K8S_TAGS


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
    ray = yaml.safe_load((KUBERAY / "raycluster.yaml").read_text())
    rayjob = yaml.safe_load((KUBERAY / "rayjob.yaml").read_text())
    dockerfile = (DEPLOY / "Dockerfile").read_text()

    dep = values["dagster-user-deployments"]["deployments"][0]
    assert f"{dep['image']['repository']}:{dep['image']['tag']}" == IMAGE
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert ray["kind"] == "RayCluster" and ray["apiVersion"].startswith("ray.io/")
    assert rayjob["kind"] == "RayJob" and rayjob["apiVersion"].startswith("ray.io/")
    pods = []
    for cluster in (ray["spec"], rayjob["spec"]["rayClusterSpec"]):
        pods += [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        assert int(cluster["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"]) >= 1
    assert {c["image"] for p in pods for c in p["spec"]["containers"]} == {IMAGE}
    assert re.search(rf"-t {re.escape(IMAGE)}\b", dockerfile)

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

    # Ray's token auth everywhere: KubeRay's authOptions on both clusters, the Dagster pods join with
    # the same Secret's token; nothing turns it off (the image included)
    for cluster in (ray["spec"], rayjob["spec"]["rayClusterSpec"]):
        assert cluster["authOptions"] == {"mode": "token", "secretName": RAY_AUTH_SECRET}
    assert RAY_AUTH_SECRET in instance["run_launcher"]["config"]["env_secrets"]
    assert "RAY_AUTH_MODE=token" in instance["run_launcher"]["config"]["env_vars"]
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert {"name": RAY_AUTH_SECRET} in launcher["envSecrets"] and "RAY_AUTH_MODE=token" in launcher[
        "envVars"
    ]
    assert {"name": RAY_AUTH_SECRET} in dep["envSecrets"]
    assert {"name": "RAY_AUTH_MODE", "value": "token"} in dep["env"]
    assert RAY_AUTH_SECRET in K8S_JOB_EXECUTOR_CONFIG["env_secrets"]
    step_env = TRAINING_OP_K8S_CONFIG["container_config"]["env"]
    assert {"name": "RAY_AUTH_MODE", "value": "token"} in step_env
    assert any(
        e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == RAY_AUTH_SECRET for e in step_env
    )
    for f in DEPLOY.rglob("*"):
        if f.is_file() and (f.suffix in (".yaml", ".yml") or f.name == "Dockerfile"):
            assert "RAY_AUTH_MODE=disabled" not in f.read_text() and "value: disabled" not in f.read_text(), f


def test_the_image_is_the_pinned_sglangs_and_keeps_sglangs_pins_apart_from_ours():
    """deploy/Dockerfile (not built here: no Docker on the CPU machine): FROM the SGLang image of
    requirements-sglang.txt's sglang, the platform in a venv of its own over it (its transformers,
    tokenizers and numba pins would break sglang's), SGLang run by the base interpreter."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (pin,) = re.findall(r"^sglang==(\S+)", (DEPLOY.parent / "requirements-sglang.txt").read_text(), re.M)
    assert re.search(rf"^ARG SGLANG_VERSION={re.escape(pin)}$", dockerfile, re.M)
    assert re.search(r"^FROM lmsysorg/sglang:v\$\{SGLANG_VERSION\}-\S+$", dockerfile, re.M)
    assert "sglang.__version__; assert v == '${SGLANG_VERSION}'" in dockerfile  # the tag carries the pin
    assert "-m venv --system-site-packages" in dockerfile
    assert re.search(
        r"^ENV PATH=/opt/miles/bin:\$PATH MILES_SGLANG_PYTHON=/usr/local/bin/python3-sglang$",
        dockerfile,
        re.M,
    )
    extras = set(re.findall(r"x\['([\w-]+)'\]", dockerfile))
    assert extras == {"gpu", "k8s", "trackers"}  # no test or dev tool in the image


# --- KubeRay: the vendored CRD schemas (deploy/kuberay/crds/README.md) as the API server applies them


@functools.cache
def _crd(kind: str) -> dict:
    with gzip.open(KUBERAY / "crds" / f"ray.io_{kind.lower()}s.v1.json.gz") as f:
        return json.load(f)


def _as_json_schema(node):
    """A k8s structural schema (OpenAPI v3.0 + x-kubernetes-*) as the JSON Schema the API server
    means: `nullable` admits null; `x-kubernetes-int-or-string` is integer or string (controller-gen
    already writes that anyOf; added where it does not). Formats are checked by _FORMATS."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            out[key] = _as_json_schema(node[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [_as_json_schema(n) for n in node[key]]
    if "properties" in node:
        out["properties"] = {k: _as_json_schema(v) for k, v in node["properties"].items()}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


# Only the formats the API server enforces on spec fields; date-time appears under status only.
_FORMATS = jsonschema.FormatChecker(formats=())
_FORMATS.checks("int32")(lambda v: not isinstance(v, int) or -(2**31) <= v < 2**31)
_FORMATS.checks("int64")(lambda v: not isinstance(v, int) or -(2**63) <= v < 2**63)


@functools.cache
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    # no check_schema: it takes seconds; test_kuberay_crd_schemas_are_the_vendored_release checks the
    # keywords instead, and the rejection tests show that the checks bite
    return jsonschema.Draft202012Validator(
        _as_json_schema(_crd(kind)["openAPIV3Schema"]), format_checker=_FORMATS
    )


def _structural_problems(obj, schema: dict, path: str) -> list[str]:
    """What the schema check cannot see: fields the API server would prune without a word (the usual
    manifest typo), duplicate keys in `x-kubernetes-list-type: map` lists (rejected on apply), and
    fields that carry CEL rules, which are not evaluated here."""
    problems = []
    if obj is not None and "x-kubernetes-validations" in schema:
        rules = [r["rule"] for r in schema["x-kubernetes-validations"]]
        problems.append(f"{path}: has CEL rules {rules} that these tests do not evaluate")
    if isinstance(obj, dict) and "properties" in schema:
        for key, value in obj.items():
            if key in schema["properties"]:
                problems += _structural_problems(value, schema["properties"][key], f"{path}.{key}")
            elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                problems.append(f"{path}.{key}: unknown field (the API server would drop it silently)")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in obj.items():
            problems += _structural_problems(value, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        if schema.get("x-kubernetes-list-type") == "map":
            keys = schema["x-kubernetes-list-map-keys"]
            seen = [tuple(item.get(k) for k in keys) for item in obj if isinstance(item, dict)]
            problems += [
                f"{path}: duplicate {keys} {k}" for k in sorted(set(seen), key=str) if seen.count(k) > 1
            ]
        for i, item in enumerate(obj):
            problems += _structural_problems(item, schema["items"], f"{path}[{i}]")
    return problems


_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _kuberay_problems(manifest: dict) -> list[str]:
    """Every reason KubeRay v1.7 (API server + operator name rules) would refuse or alter `manifest`."""
    kind = manifest.get("kind")
    if kind not in ("RayJob", "RayCluster"):
        return [f"kind {kind!r}: not RayJob or RayCluster"]
    crd = _crd(kind)
    problems = [] if manifest.get("apiVersion") == f"ray.io/{crd['version']}" else ["apiVersion"]
    problems += [f"{e.json_path}: {e.message}" for e in _validator(kind).iter_errors(manifest)]
    problems += _structural_problems(manifest, crd["openAPIV3Schema"], "$")
    # KubeRay's ValidateRay{Job,Cluster}Metadata, and the API server's namespace rule
    name, namespace = manifest["metadata"].get("name", ""), manifest["metadata"].get("namespace", "")
    max_len = RAYJOB_NAME_MAX_LEN if kind == "RayJob" else 53
    if not _DNS1035.fullmatch(name) or len(name) > max_len:
        problems.append(f"metadata.name {name!r}: not a DNS-1035 label of <= {max_len} characters")
    if not _DNS1123.fullmatch(namespace) or len(namespace) > 63:
        problems.append(f"metadata.namespace {namespace!r}: not a DNS-1123 label")
    return problems


def _yaml(name: str) -> dict:
    return yaml.safe_load((KUBERAY / name).read_text())


# Schema keywords of the vendored CRDs and who enforces each here: JSON Schema (jsonschema), _FORMATS,
# _as_json_schema, _structural_problems; x-kubernetes-map-type only sets merge semantics. A newer
# CRD with another keyword (e.g. x-kubernetes-embedded-resource) fails the test below until handled.
_KEYWORDS = {
    "type", "properties", "required", "items", "additionalProperties", "anyOf", "enum", "pattern",
    "minimum", "minLength", "maxLength", "minItems", "default", "format", "nullable",
    "x-kubernetes-int-or-string", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type", "x-kubernetes-validations", "x-kubernetes-preserve-unknown-fields",
}  # fmt: skip


def _keywords(node: dict) -> set[str]:
    found = set(node)
    subs = [*node.get("properties", {}).values(), *node.get("anyOf", [])]
    subs += [node[k] for k in ("items", "additionalProperties") if isinstance(node.get(k), dict)]
    return found.union(*(_keywords(s) for s in subs))


def test_kuberay_crd_schemas_are_the_vendored_release():
    for kind in ("RayJob", "RayCluster"):
        crd = _crd(kind)
        assert (crd["kind"], crd["version"]) == (kind, "v1")
        assert crd["commit"] == "59d663aeec13760646da3db9c1cf8cfe883e30b7" and "/v1.7.0/" in crd["source"]
        assert _keywords(crd["openAPIV3Schema"]) <= _KEYWORDS
        formats = re.findall(r'"format":"([^"]+)"', json.dumps(crd, separators=(",", ":")))
        assert set(formats) == {"int32", "int64", "date-time"}  # date-time: status fields only
    assert RAY_VERSION == importlib.metadata.version("ray")  # rayVersion is the Ray the image has


@pytest.mark.parametrize(
    "manifest",
    [
        pytest.param(lambda: _yaml("raycluster.yaml"), id="raycluster.yaml"),
        pytest.param(lambda: _yaml("rayjob.yaml"), id="rayjob.yaml"),
        pytest.param(
            lambda: rayjob_manifest(
                "Demo run #2 (fp32)", "miles-platform train --num-rollout 2", num_gpu_workers=3
            ),
            id="rayjob_manifest",
        ),
    ],
)
def test_kuberay_manifests_pass_the_crd_schemas(manifest):
    assert _kuberay_problems(manifest()) == []


def _set(path: str, value):
    def mutate(m):
        *parents, last = path.split(".")
        for p in parents:
            m = m[int(p)] if p.isdigit() else m[p]
        if value is _DELETE:
            del m[last]
        elif isinstance(m, list) and int(last) == len(m):  # one past the end: append
            m.append(value)
        else:
            m[int(last) if isinstance(m, list) else last] = value

    return mutate


def _rename(path: str, new_key: str):
    def mutate(m):
        *parents, last = path.split(".")
        for p in parents:
            m = m[int(p)] if p.isdigit() else m[p]
        m[new_key] = m.pop(last)

    return mutate


_DELETE = object()
_JOB_WORKER = "spec.rayClusterSpec.workerGroupSpecs.0"
_JOB_HEAD_C = "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0"


@pytest.mark.parametrize(
    "file, mutate, expected",
    [
        ("rayjob.yaml", _set(f"{_JOB_WORKER}.replicas", "1"), "'1' is not of type 'integer'"),
        ("rayjob.yaml", _set(f"{_JOB_WORKER}.rayStartParams.num-gpus", 8), "8 is not of type 'string'"),
        ("rayjob.yaml", _set("spec.activeDeadlineSeconds", 2**31), "is not a 'int32'"),
        ("rayjob.yaml", _set("spec.shutdownAfterJobFinishes", "true"), "'true' is not of type 'boolean'"),
        ("rayjob.yaml", _set(f"{_JOB_HEAD_C}.resources.requests.memory", "16 GiB"), "does not match"),
        ("rayjob.yaml", _set(f"{_JOB_HEAD_C}.resources.limits.memory", True), "is not valid under any"),
        ("rayjob.yaml", _rename(f"{_JOB_HEAD_C}.name", "nmae"), "'name' is a required property"),
        ("rayjob.yaml", _rename(f"{_JOB_HEAD_C}.name", "nmae"), ".nmae: unknown field"),
        ("rayjob.yaml", _rename("spec.shutdownAfterJobFinishes", "shutdownAfterJobFinish"), "unknown field"),
        ("rayjob.yaml", _rename("spec.rayClusterSpec", "rayClusterSpecs"), "unknown field"),
        ("rayjob.yaml", _set(f"{_JOB_HEAD_C}.env.1", {"name": "MILES_STORAGE_ROOT", "value": "x"}),
         "duplicate ['name']"),
        ("rayjob.yaml", _set("spec.rayClusterSpec.authOptions.mode", "tokens"), "is not one of"),
        ("rayjob.yaml", _set("spec.rayClusterSpec.headGroupSpec", _DELETE), "'headGroupSpec' is a required"),
        ("rayjob.yaml", _set("spec.managedBy", "ray.io/kuberay-operator"), "CEL rules"),
        ("rayjob.yaml", _set("metadata.name", "GRPO_demo"), "DNS-1035"),
        ("rayjob.yaml", _set("metadata.name", "g" * 48), "DNS-1035"),
        ("raycluster.yaml", _set("spec.workerGroupSpecs.0.minReplicas", _DELETE), "'minReplicas' is a required"),
        ("raycluster.yaml", _set("spec.headGroupSpec.template.spec.containers.0.ports.0.containerPort", "6379"),
         "'6379' is not of type 'integer'"),
        ("raycluster.yaml", _set("spec.workerGroupSpecs.0.template.spec.volumes.0.emptyDir.medium", 1),
         "1 is not of type 'string'"),
        ("raycluster.yaml", _set("apiVersion", "ray.io/v1alpha1"), "apiVersion"),
    ],
)  # fmt: skip
def test_broken_kuberay_manifests_are_rejected(file, mutate, expected):
    manifest = copy.deepcopy(_yaml(file))
    mutate(manifest)
    problems = _kuberay_problems(manifest)
    assert any(expected in p for p in problems), problems


def test_rayjob_yaml_is_rayjob_manifest_and_a_valid_grpo_run():
    job, cluster = _yaml("rayjob.yaml"), _yaml("raycluster.yaml")
    assert job == rayjob_manifest(job["metadata"]["name"], job["spec"]["entrypoint"])
    # the per-run cluster is the long-lived one at a fixed size (same image, env, ports, GPUs)
    assert cluster["spec"] == ray_cluster_spec(replicas=2, min_replicas=0, max_replicas=8)
    assert job["spec"]["shutdownAfterJobFinishes"] and job["spec"]["ttlSecondsAfterFinished"] >= 0

    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["miles-platform", "train"]
    cfg = parse_run_config(argv[2:])
    assert cfg.run_name == job["metadata"]["name"] and cfg.advantage_estimator == "grpo"
    assert cfg.storage_root == STORAGE_ROOT  # train does not read MILES_STORAGE_ROOT itself
    assert cfg.ray_address is None  # the driver joins through RAY_ADDRESS
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"]
    gpus_needed = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node + (
        0 if cfg.colocate else cfg.rollout_num_gpus
    )
    assert gpus_needed <= workers * GPUS_PER_TRAINING_POD


def test_rayjob_name_is_a_kuberay_name_and_keeps_runs_apart():
    assert rayjob_name("grpo-demo") == "grpo-demo"  # already valid: unchanged
    odd = ["Demo_1", "demo.1", "demo-1-", "2026-12-02", "x" * 200, "y" * 47 + "z", "Ünïcode run"]
    names = [rayjob_name(r) for r in odd]
    assert len(set(names)) == len(odd)
    for run, name in zip(odd, names):
        assert _DNS1035.fullmatch(name) and len(name) <= RAYJOB_NAME_MAX_LEN, (run, name)
        assert rayjob_name(run) == name  # stable: re-applying a run's RayJob finds the same object
    assert names[0].startswith("demo-1-") and names[3].startswith("run-2026-12-02-")
    for hopeless in ("", "___", "☃"):
        with pytest.raises(ValueError, match="run name .*--run-name"):
            rayjob_name(hopeless)
    with pytest.raises(ValueError, match="num_gpu_workers=0"):
        rayjob_manifest("r", "miles-platform train", num_gpu_workers=0)
    with pytest.raises(ValueError, match="active_deadline_seconds=0"):
        rayjob_manifest("r", "miles-platform train", active_deadline_seconds=0)
