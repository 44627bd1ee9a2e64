"""kill -9 of the driver at every --ci-fault-hooks point, then the same command again (issue 19);
`make test` runs the chain over one hook of each part of a step (`PARTS`), `make test-extended` over
every hook.

One chain of `miles-platform train` processes on one run: each launch is SIGKILLed at the next
point of the matrix (a later rollout than the last checkpoint, so every launch gets further), the
last one runs without a fault and finishes. Against an uninterrupted run of the same config:
no rollout id lost or trained twice, exactly one committed version per rollout chained parent to
child, metrics of each rollout exactly once among the committed rows, every version the crashes
left behind marked abandoned, no staging dir left, the disk-delta publication chain replays to the
final weights, and those weights equal the uninterrupted run's bit for bit.
"""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from loop_helpers import small_run_kwargs, warm_python

from miles_platform.fault_hooks import HOOKS, parse_fault_hooks
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths
from miles_platform.store.run_events import abandoned_numbers, resume_events

NUM_ROLLOUT = 8
# (hook, rollout) in launch order; checkpoints at rollouts 1, 3, 5, 7 (--save-interval 2), and at 2: the
# --save-trigger-sentinel file is created before the save_start launch, whose forced save at rollout 2
# is killed before it writes; the file stays, and the next launch saves rollout 2 and removes it
MATRIX = [
    ("orchestrator_step_start", 0), ("rollout_end", 0), ("trainer_controller_step_start", 0),
    ("trainer_controller_step_end", 1), ("weight_update_start", 1), ("weight_update_prepared", 2),
    ("weight_update_paused", 2), ("weight_update_activated", 3), ("version_recorded", 3),
    ("eval_start", 3), ("metrics_recorded", 3), ("save_start", 2), ("save_end", 5),
    ("orchestrator_step_end", 6),
]  # fmt: skip


# `make test`'s chain (5 launches, ~25 s of a full run): a launch that leaves nothing (the step's
# start), one killed with the engines paused mid update (its step trained, no version), a forced
# save killed before it writes, a periodic save killed once written, a step's end past the last
# checkpoint (its version abandoned). Every hook: `make test-extended` (14 launches, ~60 s)
PARTS = [m for m in MATRIX if m[0] in ("orchestrator_step_start", "weight_update_paused", "save_start", "save_end",
                                       "orchestrator_step_end")]  # fmt: skip


def test_the_matrix_covers_every_hook():
    assert sorted(h for h, _ in MATRIX) == sorted(HOOKS)
    assert len(PARTS) == 5 and [m for m in MATRIX if m in PARTS] == PARTS


def _run_kwargs(ckpt, tmp_path, root):
    kw = small_run_kwargs(ckpt, tmp_path, storage_root=str(root), num_rollout=NUM_ROLLOUT, save_interval=2,
                          update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(root / "pub"),
                          eval_prompt_data=["heldout", str(tmp_path / "train.jsonl")], eval_interval=1,
                          skip_eval_before_train=True, rm_type=None,
                          custom_rm_path="loop_helpers.first_token_parity_rm",
                          save_trigger_sentinel=str(root / "save_now"))  # fmt: skip
    kw["save"] = str(StoragePaths(str(root)).checkpoints("t"))
    return kw


def _weights_hash(hf_dir: str) -> str:
    from safetensors.torch import load_file

    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode() + state[k].contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


def _launch(config: Path, ray_address: str, hooks: list | None, log: Path) -> int:
    """One `miles-platform train` process (a fork of the warm fork server: torch already imported)."""
    argv = [*warm_python(), "-m", "miles_platform.cli", "train", "--config", str(config), "--ray-address", ray_address]  # fmt: skip
    if hooks:
        argv += ["--ci-fault-hooks", json.dumps(hooks)]
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(argv[-6:])}\n")
        f.flush()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
            ),
        }
        return subprocess.run(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=300, check=False
        ).returncode


@pytest.mark.slow
@pytest.mark.parametrize("matrix", [pytest.param(PARTS, id="parts"),
                                    pytest.param(MATRIX, id="every_hook", marks=pytest.mark.extended)])  # fmt: skip
def test_kill_9_at_every_hook_then_relaunch_loses_and_duplicates_nothing(
    tiny_hf_checkpoint, tmp_path, matrix
):
    import ray

    from miles_platform.cluster import ray_cluster
    from miles_platform.config import RunConfig
    from miles_platform.loop import train
    from miles_platform.training.checkpoint import iter_dir
    from miles_platform.weights.delta_format import read_latest
    from miles_platform.weights.disk_delta import apply_to_state_dict

    # the uninterrupted reference, in this process
    ref = train(RunConfig(**_run_kwargs(tiny_hf_checkpoint, tmp_path, tmp_path / "ref")).validate())
    assert ref.final_version == NUM_ROLLOUT
    assert any(
        m["train/grad_norm"] > 0 for m in ref.metrics
    )  # the weights move: the comparison means something
    ray_cluster.init_ray(
        RunConfig(**_run_kwargs(tiny_hf_checkpoint, tmp_path, tmp_path / "ref"))
    )  # joined: a no-op
    address = ray.get_runtime_context().gcs_address  # the crash chain joins this worker's cluster

    root = tmp_path / "root"
    kw = _run_kwargs(tiny_hf_checkpoint, tmp_path, root)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in kw.items()}))
    log = tmp_path / "launches.log"
    saved_2 = False
    for i, (hook, rollout) in enumerate(matrix):
        req = [
            {
                "request_id": f"k{i}",
                "hook_name": hook,
                "action": {"kind": "kill_process"},
                "rollout_id": rollout,
            }
        ]
        parse_fault_hooks(req)
        if hook == "save_start":  # a save requested by the sentinel at a rollout that is no save point
            (root / "save_now").touch()
        rc = _launch(config, address, req, log)
        assert rc == -9, (
            f"launch {i} ({hook} @ rollout {rollout}) exited {rc}, not by SIGKILL:\n{log.read_text()[-3000:]}"
        )
        assert f"kill_process at {hook}, rollout {rollout}" in log.read_text()
        # killed in its forced save, the request stays; the next launch saves rollout 2 and removes it
        saved_2 = saved_2 or hook == "save_end"
        assert (root / "save_now").exists() == (hook == "save_start"), hook
        assert os.path.exists(iter_dir(kw["save"], 2)) == saved_2, hook
    assert "--save-trigger-sentinel" in log.read_text() and "saved rollout 2" in log.read_text()
    assert _launch(config, address, None, log) == 0, log.read_text()[-3000:]

    paths, cat = StoragePaths(str(root)), Catalog(StoragePaths(str(root)))
    # exactly one committed version per rollout, each the child of the previous rollout's
    _, rows = cat.query("select rollout_id, version, parent_version from policy_versions "
                        "where status = 'committed' order by rollout_id")  # fmt: skip
    assert [r[0] for r in rows] == list(range(NUM_ROLLOUT)), rows
    assert all(rows[i][2] == (rows[i - 1][1] if i else 0) for i in range(len(rows))), rows
    final = rows[-1][1]
    # what the crashes left behind is abandoned, and each number is used once; rows of a crashed
    # launch's last second were never written (store/tables.BufferedParts), its versions' numbers
    # are abandoned all the same: every number up to the final one is committed or abandoned
    _, versions = cat.query("select version, status from policy_versions order by version")
    numbers = [v for v, _ in versions]
    assert len(numbers) == len(set(numbers))
    assert {s for _, s in versions} <= {"committed", "abandoned"} and final == max(numbers)
    gone = abandoned_numbers(resume_events(paths, "t"))
    assert set(range(1, final + 1)) == {v for v, s in versions if s == "committed"} | gone, (versions, gone)
    _, events = cat.query("select count(*) from run_events where event = 'resume'")
    # every launch after the second found rows of a crashed one (the first crash left none)
    assert events[0][0] == len(matrix) - 1
    # the committed metrics: every rollout exactly once per metric
    _, dup = cat.query("select rollout_id, name, count(*) from metrics where status = 'committed' "
                       "group by 1, 2 having count(*) <> 1")  # fmt: skip
    assert dup == []
    _, per = cat.query("select distinct rollout_id from metrics where status = 'committed' order by 1")
    assert [r[0] for r in per] == list(range(NUM_ROLLOUT))
    # every rollout's shard, with its samples (2 prompts x 2)
    _, shards = cat.query("select rollout_id, count(*) from rollouts group by 1 order by 1")
    assert shards == [(r, 4) for r in range(NUM_ROLLOUT)]
    # evals of committed versions only once per version
    _, ev = cat.query(
        "select version, count(*) from evals where status = 'committed' and metric = 'pass@1' group by 1"
    )
    assert all(c == 1 for _, c in ev) and ev
    # no staging dir of a killed writer anywhere under the root
    assert [p for p in root.rglob("*") if ".tmp-" in p.name] == []
    # the final weights: the uninterrupted run's, bit for bit; the publication replays to them
    final_dir = paths.hf_export("t", final)
    assert _weights_hash(final_dir) == _weights_hash(ref.final_hf_path)
    assert read_latest(root / "pub") == final
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(tiny_hf_checkpoint, "model.safetensors"))
    assert apply_to_state_dict(root / "pub", state, None) == final
    save_file(state, str(tmp_path / "replayed.safetensors"))
    want = load_file(os.path.join(final_dir, "model.safetensors"))
    assert all((state[k] == want[k]).all() for k in want)
