"""kill -9 of a trainer rank at a --ci-fault-hooks point inside the rank (Miles'
`trainer_step_before_allreduce`, and `trainer_weight_update_before_send` of the broadcast
transport), then the same command again (issue 19).

The first `train` process loses its TrainerActor mid-step in rollout 1 and exits 1 with one message
naming the actor, the hook due in it and the resume command; the relaunch (the same config, without
the fault) resumes from rollout 0's checkpoint and finishes. Against an uninterrupted run: every
rollout has exactly one committed version chained parent to child, no version number is used twice,
each rollout's metrics appear once among the committed rows, and the final weights are equal bit for
bit.
"""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from loop_helpers import small_run_kwargs, warm_python

from miles_platform.fault_hooks import RANK_HOOKS
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths

NUM_ROLLOUT = 3


def _kill(hook: str) -> dict:
    return {"request_id": "rank-kill", "hook_name": hook, "action": {"kind": "kill_process"}, "rollout_id": 1}


def _run_kwargs(ckpt, tmp_path, root, **extra):
    kw = small_run_kwargs(ckpt, tmp_path, storage_root=str(root), num_rollout=NUM_ROLLOUT, save_interval=1,
                          rm_type=None, custom_rm_path="loop_helpers.first_token_parity_rm", **extra)  # fmt: skip
    kw["save"] = str(StoragePaths(str(root)).checkpoints("t"))
    return kw


def _weights_hash(hf_dir: str) -> str:
    from safetensors.torch import load_file

    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode() + state[k].contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


def _launch(config: Path, ray_address: str, hooks: list | None, log: Path) -> tuple[int, str]:
    """One `miles-platform train` process (a fork of the warm fork server); -> (exit code, its output)."""
    argv = [*warm_python(), "-m", "miles_platform.cli", "train", "--config", str(config), "--ray-address", ray_address]  # fmt: skip
    if hooks:
        argv += ["--ci-fault-hooks", json.dumps(hooks)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(argv[-6:])}\n{p.stdout}{p.stderr}")
    return p.returncode, p.stdout + p.stderr


def test_rank_hooks_are_miles_names():
    assert {"trainer_step_before_allreduce", "trainer_weight_update_before_send"} <= set(RANK_HOOKS)


# the rank dies mid-step (before the all-reduce), or in the broadcast transport's sending rank with
# the engines waiting in the weight group (the only transport that sends from a rank)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("hook", "transport"),
    [
        ("trainer_step_before_allreduce", {}),
        ("trainer_weight_update_before_send", {"update_weight_transfer_mode": "broadcast"}),
    ],
)
def test_kill_9_of_a_trainer_rank_at_a_rank_hook_stops_the_run_and_the_relaunch_resumes(
    tiny_hf_checkpoint, tmp_path, hook, transport
):
    import ray

    from miles_platform.cluster import ray_cluster
    from miles_platform.config import RunConfig
    from miles_platform.loop import train

    ref = train(
        RunConfig(**_run_kwargs(tiny_hf_checkpoint, tmp_path, tmp_path / "ref", **transport)).validate()
    )
    assert ref.final_version == NUM_ROLLOUT and any(m["train/grad_norm"] > 0 for m in ref.metrics)
    ray_cluster.init_ray(RunConfig(**_run_kwargs(tiny_hf_checkpoint, tmp_path, tmp_path / "ref")))  # joined
    address = ray.get_runtime_context().gcs_address

    root = tmp_path / "root"
    kw = _run_kwargs(tiny_hf_checkpoint, tmp_path, root, **transport)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(kw))
    log = tmp_path / "launches.log"

    rc, out = _launch(config, address, [_kill(hook)], log)
    assert rc == 1, f"exited {rc}:\n{out[-3000:]}"
    assert "TrainerActor of run 't' died" in out, out[-3000:]
    assert f"rank-kill (kill_process at {hook}, rollout 1)" in out, out[-3000:]
    assert f"relaunch the same command to resume from the last checkpoint under {kw['save']}" in out
    assert "Traceback" not in out, out[-3000:]  # one message, not Ray's traceback
    cat = Catalog(StoragePaths(str(root)))
    # the rank died inside rollout 1's step or its weight update: rollout 0 is recorded and
    # checkpointed, rollout 1 is not
    _, rows = cat.query("select rollout_id from policy_versions order by rollout_id")
    assert [r[0] for r in rows] == [0], rows

    rc, out = _launch(config, address, None, log)
    assert rc == 0, out[-3000:]
    _, rows = cat.query("select rollout_id, version, parent_version from policy_versions "
                        "where status = 'committed' order by rollout_id")  # fmt: skip
    assert [r[0] for r in rows] == list(range(NUM_ROLLOUT)), rows
    assert all(rows[i][2] == (rows[i - 1][1] if i else 0) for i in range(len(rows))), rows
    _, versions = cat.query("select version from policy_versions")
    assert len(versions) == len({v for (v,) in versions}) == NUM_ROLLOUT  # nothing abandoned, none reused
    _, dup = cat.query("select rollout_id, name, count(*) from metrics where status = 'committed' "
                       "group by 1, 2 having count(*) <> 1")  # fmt: skip
    assert dup == []
    _, per = cat.query("select distinct rollout_id from metrics where status = 'committed' order by 1")
    assert [r[0] for r in per] == list(range(NUM_ROLLOUT))
    _, shards = cat.query("select rollout_id, count(*) from rollouts group by 1 order by 1")
    assert shards == [(r, 4) for r in range(NUM_ROLLOUT)]
    _, events = cat.query("select count(*) from run_events where event = 'resume'")
    assert events[0][0] == 1
    final = StoragePaths(str(root)).hf_export("t", rows[-1][1])
    assert _weights_hash(final) == _weights_hash(ref.final_hf_path)
