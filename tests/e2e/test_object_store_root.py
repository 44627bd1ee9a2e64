"""An s3:// storage root end to end, against a local S3 server (moto) on 127.0.0.1: a GRPO run
with checkpoints and disk-delta publication on the store, a resume from the store with nothing
left on local disk, then the store's contents (nothing partial), `miles-platform query` over
its Parquet and `miles-platform weights` reading its publication."""

import io
import json
import os
import shutil
import time
from contextlib import redirect_stdout

import pytest
from loop_helpers import small_run_config
from store_builders import point_s3_at

from miles_platform.config import ConfigError
from miles_platform.loop import train, validate_before_start
from miles_platform.store.paths import StoragePaths

pytest.importorskip("moto.server", reason="moto[server] not installed")
pytest.importorskip("s3fs", reason="s3fs not installed")

BUCKET = "miles"
ROOT = f"s3://{BUCKET}/root"
PUB = f"{ROOT}/runs/t/publications"


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path, tiny_hf_checkpoint):
    """The env pointing s3fs at the server, a fresh bucket, and a local cache dir of this test's.
    This worker's Ray (and its fork server) is started first, without that env: the trainer and
    engine actors reach the store only if the run hands them the driver's endpoint and credentials."""
    from miles_platform.cluster import ray_cluster

    assert not {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(os.environ)
    ray_cluster.init_ray(small_run_config(tiny_hf_checkpoint, tmp_path))
    point_s3_at(monkeypatch, {**s3_server, "AWS_SECRET_ACCESS_KEY": SECRET})  # moto takes any secret
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    import fsspec

    fs = fsspec.filesystem("s3")
    if fs.exists(BUCKET):
        fs.rm(BUCKET, recursive=True)
    fs.mkdir(BUCKET)
    return fs


SECRET = f"miles-test-secret-{os.getpid()}-{time.time_ns()}"


def _ray_logs_with(text: str) -> list[str]:
    """The files under this Ray session's dir that contain `text` (the runtime-env agent logged
    every env var of an actor's runtime env there, 0644, never cleaned)."""
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    hits = []
    for d, _, files in os.walk(session):
        for f in files:
            try:
                with open(os.path.join(d, f), "rb") as fh:
                    if text.encode() in fh.read():
                        hits.append(os.path.join(d, f))
            except OSError:
                continue
    return hits


def _cfg(ckpt, tmp_path, num_rollout):
    return small_run_config(
        ckpt, tmp_path, storage_root=ROOT, num_rollout=num_rollout, save_interval=2,
        update_weight_transfer_mode="disk-delta", update_weight_disk_dir=PUB, check_weight_update_equal=True,
        eval_prompt_data=["heldout", str(tmp_path / "train.jsonl")], eval_interval=2,
        custom_rm_path="loop_helpers.first_token_parity_rm",  # reward variance: the weights move
    )  # fmt: skip


def _query(sql: str) -> list[dict]:
    from miles_platform.store.catalog import cli_main

    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main([sql, "--storage-root", ROOT, "--format", "json"]) == 0
    return json.loads(out.getvalue())


def test_a_run_on_s3_checkpoints_publishes_resumes_from_the_store_and_is_queryable(
    tiny_hf_checkpoint, tmp_path, s3
):
    res = train(_cfg(tiny_hf_checkpoint, tmp_path, 2))
    assert res.final_version == 2 and res.final_hf_path == f"{ROOT}/runs/t/hf/v000002"
    # the actors reached the store with the driver's secret, and no Ray log holds it (issue #49, item 2)
    assert not _ray_logs_with(SECRET)
    assert s3.cat_file(f"{BUCKET}/root/runs/t/checkpoints/latest_checkpointed_iteration.txt") == b"1"

    # a fresh host: nothing of the first run on local disk; the resume reads everything from S3.
    # On the store, what a writer killed mid-upload leaves: part of checkpoint iter_0000003 (no
    # trainer_state.json, no pointer) and the payload of publication v3 (no index.json, no LATEST)
    shutil.rmtree(tmp_path / "cache")
    s3.pipe_file(f"{BUCKET}/root/runs/t/checkpoints/iter_0000003/model.safetensors", b"torn")
    s3.pipe_file(f"{BUCKET}/root/runs/t/publications/weight_v000003/payload.bin", b"torn")
    s3.pipe_file(f"{BUCKET}/root/runs/t/publications/weight_v000009/payload.bin", b"torn")  # above LATEST
    res = train(_cfg(tiny_hf_checkpoint, tmp_path, 4))
    assert res.start_rollout_id == 2 and res.final_version == 4
    assert [v["version"] for v in res.versions] == [3, 4]

    keys = [k.removeprefix(f"{BUCKET}/root/") for k in s3.find(BUCKET)]
    assert not [k for k in keys if ".tmp-" in k], "a temp name was left on the store"
    assert not [k for k in keys if "weight_v000009" in k], "a torn publication above LATEST was left"
    ckpt = "runs/t/checkpoints"
    assert s3.cat_file(f"{BUCKET}/root/{ckpt}/latest_checkpointed_iteration.txt") == b"3"
    for it in (1, 3):
        assert f"{ckpt}/iter_{it:07d}/trainer_state.json" in keys
        assert s3.size(f"{BUCKET}/root/{ckpt}/iter_{it:07d}/model.safetensors") > 1000  # iter 3: rewritten
    assert f"{ckpt}/run_config.json" in keys
    from miles_platform.store.run_health import saved_run_config
    from miles_platform.store.tables import read_rows

    saved = saved_run_config(StoragePaths(ROOT), "t", read_rows(StoragePaths(ROOT), "policy_versions", "t"))
    assert saved is not None and saved.num_rollout == 4  # what sensors read for an s3 run's eval config
    for v in (1, 2, 3, 4):
        assert f"runs/t/hf/v{v:06d}/model.safetensors" in keys
        assert f"runs/t/hf/v{v:06d}/config.json" in keys
    assert [f"rollouts/run=t/rollout_id={i:06d}/part-0.parquet" for i in range(4)] == sorted(
        k for k in keys if k.startswith("rollouts/")
    )
    for table in ("policy_versions", "metrics", "lineage", "evals", "train_samples"):
        # compacted when the run ended (train_samples: the trainer's rows)
        assert len([k for k in keys if k.startswith(f"tables/{table}/run=t/part-")]) == 1, table
    pub = sorted(k.removeprefix("runs/t/publications/") for k in keys if "/publications/" in k)
    assert pub == ["LATEST"] + [
        f"weight_v{v:06d}/{f}" for v in range(5) for f in ("index.json", "payload.bin")
    ]
    assert not os.path.exists("s3:") and not os.path.exists(tmp_path / "s3:")  # no URI used as a path

    # DuckDB over the store's Parquet, through the CLI's query path (no catalog file on S3)
    assert StoragePaths(ROOT).missing_root_error("miles-platform query") is None
    assert "s3://miles/typo does not exist" in StoragePaths("s3://miles/typo").missing_root_error("q")
    rows = _query("select rollout_id, count(*) n from rollouts where run = 't' group by 1 order by 1")
    assert rows == [{"rollout_id": i, "n": 4} for i in range(4)]
    rows = _query(
        "select p.version, p.rollout_id, p.hf_path, count(r.index) n from policy_versions p "
        "join rollouts r on r.run = p.run and r.rollout_id = p.rollout_id group by all order by 1"
    )
    assert [(r["version"], r["rollout_id"], r["n"]) for r in rows] == [(v, v - 1, 4) for v in (1, 2, 3, 4)]
    assert rows[-1]["hf_path"] == f"{ROOT}/runs/t/hf/v000004"
    evals = _query("select version, value from evals where metric = 'pass@1' order by 1")
    assert [r["version"] for r in evals] == [0, 2, 4]
    rows = _query(
        "select version, count(*) n from train_samples join rollouts using (run, rollout_id, index) "
        "where train_samples.status = 'committed' group by 1 order by 1"
    )
    assert [(r["version"], r["n"]) for r in rows] == [(v, 4) for v in (1, 2, 3, 4)]

    # `miles-platform eval` of the v4 export on S3 (downloaded): the loop's greedy pass@1 of v4
    from miles_platform.rollout.evaluate import cli_main as eval_cli

    out = io.StringIO()
    with redirect_stdout(out):
        assert eval_cli(["--hf-checkpoint", f"{ROOT}/runs/t/hf/v000004", "--eval-prompt-data", "heldout",
                         str(tmp_path / "train.jsonl"), "--eval-max-response-len", "4", "--json",
                         "--custom-rm-path", "loop_helpers.first_token_parity_rm"]) == 0  # fmt: skip
    heldout = json.loads(out.getvalue())["heldout"]
    assert heldout["num_prompts"] == 8 and heldout["pass@1"] == evals[-1]["value"]

    # `miles-platform weights` reads the publication on S3; applied, it equals the HF export of v4
    from miles_platform.store.remote import local_dir
    from miles_platform.weights.cli import cli_main as weights_cli
    from miles_platform.weights.cli import load_hf_state

    out = io.StringIO()
    with redirect_stdout(out):
        assert weights_cli(["list", "--pub", PUB]) == 0
        assert weights_cli(["apply", "--pub", PUB, "--checkpoint", str(tmp_path / "replica")]) == 0
    assert f"{PUB}: LATEST v4" in out.getvalue() and "at v4 (verified)" in out.getvalue()
    replica = load_hf_state(str(tmp_path / "replica"))
    with local_dir(f"{ROOT}/runs/t/hf/v000004") as d:
        export = load_hf_state(d)
    assert replica.keys() == export.keys() and all((replica[k] == export[k]).all() for k in export)


def test_what_an_object_store_root_cannot_do_is_refused_before_start(tiny_hf_checkpoint, tmp_path):
    for kw, flag in (
        (dict(lora_rank=4, lora_alpha=8), "--lora-rank 4 with --storage-root s3://"),
        (dict(save_hf=str(tmp_path / "copy")), "--save-hf .* with --storage-root s3://"),
        (
            dict(rollout_engine="sglang", update_weight_transfer_mode="disk"),
            "--update-weight-transfer-mode disk with --storage-root s3://.*SGLang engines",
        ),
    ):
        cfg = small_run_config(tiny_hf_checkpoint, tmp_path, storage_root=ROOT, **kw)
        with pytest.raises(ConfigError, match=flag):
            validate_before_start(cfg)
    cfg = small_run_config(tiny_hf_checkpoint, tmp_path, storage_root=str(tmp_path / "root"),
                           update_weight_local_checkpoint_dir="s3://b/engine-local")  # fmt: skip
    with pytest.raises(ConfigError, match="--update-weight-local-checkpoint-dir"):
        validate_before_start(cfg)
