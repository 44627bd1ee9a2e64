"""Committed / abandoned rows after a resume (store/run_events.py) and the --ci-fault-hooks parser."""

import json
import time

import pytest

from miles_platform.errors import ConfigError
from miles_platform.fault_hooks import HOOKS, PHASES, FaultHooks, FaultInjected, parse_fault_hooks
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths, partition_key
from miles_platform.store.run_events import committed_rows, record_resume, resume_events
from miles_platform.store.tables import append_rows, read_rows


def _version(paths, run, v, parent, rid):
    append_rows(paths, "policy_versions", run, [{"version": v, "parent_version": parent, "rollout_id": rid,
                                                 "partition_key": partition_key(run, v)}])  # fmt: skip
    append_rows(
        paths, "metrics", run, [{"rollout_id": rid, "step": rid, "name": "train/loss", "value": float(v)}]
    )
    append_rows(paths, "evals", run, [{"version": v, "partition_key": partition_key(run, v), "dataset": "d",
                                       "metric": "pass@1", "value": 0.5}])  # fmt: skip
    time.sleep(0.002)  # distinct created_at


def test_a_resume_abandons_what_the_crashed_attempt_made_after_its_checkpoint(tmp_path):
    paths = StoragePaths(str(tmp_path))
    for v in range(1, 5):  # attempt 1: rollouts 0..3 -> v1..v4; its last checkpoint holds rollout 1 (v2)
        _version(paths, "r", v, v - 1, v - 1)
    append_rows(
        paths, "policy_versions", "other", [{"version": 9, "rollout_id": 9}]
    )  # another run: untouched
    # v5 was exported (hf/v000005) but its row never written: abandoned too, though not in the table
    assert record_resume(paths, "r", 1, 2, 5, ["--lr 0.001 -> 0.002"]) == [3, 4, 5]
    for v, rid in ((6, 2), (7, 3)):  # attempt 2 redoes rollouts 2 and 3, branching from v2
        _version(paths, "r", v, 2 if v == 6 else 6, rid)
    cat = Catalog(paths)
    _, rows = cat.query("select run, version, status from policy_versions order by run, version")
    assert rows == [("other", 9, "committed"), ("r", 1, "committed"), ("r", 2, "committed"), ("r", 3, "abandoned"),
                    ("r", 4, "abandoned"), ("r", 6, "committed"), ("r", 7, "committed")]  # fmt: skip
    _, m = cat.query("select rollout_id, value, status from metrics where run = 'r' order by created_at")
    assert m == [(0, 1.0, "committed"), (1, 2.0, "committed"), (2, 3.0, "abandoned"), (3, 4.0, "abandoned"),
                 (2, 6.0, "committed"), (3, 7.0, "committed")]  # fmt: skip
    _, e = cat.query("select version from evals where run = 'r' and status = 'abandoned' order by 1")
    assert e == [(3,), (4,)]
    # the Python readers apply the same rule
    assert [r["version"] for r in committed_rows(paths, "policy_versions", "r")] == [1, 2, 6, 7]
    assert [r["value"] for r in committed_rows(paths, "metrics", "r")] == [1.0, 2.0, 6.0, 7.0]
    ev = resume_events(paths, "r")
    assert len(ev) == 1 and json.loads(ev[0]["detail"])["config_changes"] == ["--lr 0.001 -> 0.002"]
    # a second crash (after v7, before its checkpoint) and resume from rollout 2 (v6): only v7 goes;
    # numbers an earlier resume abandoned are not listed again
    assert record_resume(paths, "r", 2, 6, 7, []) == [7]
    assert [r["version"] for r in committed_rows(paths, "policy_versions", "r")] == [1, 2, 6]
    _, n = cat.query("select count(*) from run_events")
    assert n == [(2,)]


def test_a_run_never_resumed_has_every_row_committed(tmp_path):
    paths = StoragePaths(str(tmp_path))
    _version(paths, "r", 1, 0, 0)
    assert committed_rows(paths, "policy_versions", "r") == read_rows(paths, "policy_versions", "r")
    _, rows = Catalog(paths).query("select status from policy_versions union all select status from metrics")
    assert rows == [("committed",), ("committed",)]


def test_fault_hook_requests_are_checked_and_fire_once_in_their_rollout():
    reqs = parse_fault_hooks(json.dumps([
        {"request_id": "a", "hook_name": "rollout_end", "action": {"kind": "raise", "message": "boom"}, "rollout_id": 2},
        {"hook_name": "save_end", "action": {"kind": "sleep", "seconds": 0}},
    ]))  # fmt: skip
    logged = []
    hooks = FaultHooks(reqs, logged.append)
    hooks.rollout_id = 1
    hooks.fire("rollout_end")  # not its rollout
    hooks.fire("save_end")  # any rollout: fires
    hooks.fire("save_end")  # once
    hooks.rollout_id = 2
    with pytest.raises(FaultInjected, match="boom"):
        hooks.fire("rollout_end")
    hooks.fire("rollout_end")
    assert logged == ["[ci-fault-hooks] hook-1: sleep at save_end, rollout 1",
                      "[ci-fault-hooks] a: raise at rollout_end, rollout 2"]  # fmt: skip
    assert parse_fault_hooks(None) == [] and len(HOOKS) == len(set(HOOKS))


def test_each_loop_phase_fires_its_hooks_around_it_in_the_documented_order():
    """The loops' phases (fault_hooks.PHASES) name every driver hook once but the update session's
    `weight_update_paused`; a phase fires its after-hook only when its block completes."""
    named = [h for pair in PHASES.values() for h in pair if h]
    assert sorted(named) == sorted(h for h in HOOKS if h != "weight_update_paused")
    observe = [{"hook_name": h, "action": {"kind": "observe"}, "request_id": h} for h in HOOKS]
    logged = []
    hooks = FaultHooks(parse_fault_hooks(json.dumps(observe)), logged.append)
    fired = lambda: [m.split(" at ")[1].split(",")[0] for m in logged]  # noqa: E731
    with hooks.phase("step"):
        with hooks.phase("rollout"):
            assert fired() == ["orchestrator_step_start"]
        with hooks.phase("train"):
            pass
        with pytest.raises(RuntimeError), hooks.phase("save"):
            raise RuntimeError("the checkpoint failed")  # save_start fired, save_end never
    assert fired() == ["orchestrator_step_start", "rollout_end", "trainer_controller_step_start",
                       "trainer_controller_step_end", "save_start", "orchestrator_step_end"]  # fmt: skip
    logged.clear()
    hooks = FaultHooks(parse_fault_hooks(json.dumps(observe)), logged.append)
    with hooks.phase("step", end=False), hooks.phase("metrics"):  # train's --debug-rollout-only step
        pass
    assert fired() == ["orchestrator_step_start", "metrics_recorded"]


@pytest.mark.parametrize(
    "value, match",
    [
        ("[{", "not JSON"),
        ('{"hook_name": "save_end"}', "expected a JSON array"),
        (
            '[{"hook_name": "nowhere", "action": {"kind": "kill_process"}}]',
            "hook_name 'nowhere'; choose one of",
        ),
        (
            '[{"hook_name": "save_end", "action": {"kind": "stop_cell", "cell_id": "x"}}]',
            "acts on Miles cells",
        ),
        ('[{"hook_name": "save_end", "action": {"kind": "explode"}}]', "action kind 'explode'"),
        ('[{"hook_name": "save_end", "action": {"kind": "sleep"}}]', 'sleep needs "seconds"'),
        # 1e308 raised OverflowError inside the run; exit code 0 ended the run worker as a success
        (
            '[{"hook_name": "save_end", "action": {"kind": "sleep", "seconds": 1e308}}]',
            "or use sleep_forever",
        ),
        (
            '[{"hook_name": "save_end", "action": {"kind": "sleep", "seconds": true}}]',
            'sleep needs "seconds"',
        ),
        ('[{"hook_name": "save_end", "action": {"kind": "exit_process", "exit_code": 0}}]', r"in \[1, 255\]"),
        ('[{"hook_name": "save_end", "action": {"kind": "kill_process", "x": 1}}]', "takes no parameters"),
        (
            '[{"hook_name": "save_end", "action": {"kind": "kill_process"}, "rollout_id": -1}]',
            "rollout_id must be",
        ),
        ('[{"hook_name": "save_end", "action": "kill", "when": 1}]', r"unknown key\(s\) \['when'\]"),
    ],
)
def test_bad_fault_hooks_are_refused_by_validate(value, match, tiny_hf_checkpoint, tmp_path):
    from loop_helpers import small_run_kwargs

    from miles_platform.config import RunConfig

    with pytest.raises(ConfigError, match=match):
        RunConfig(**small_run_kwargs(tiny_hf_checkpoint, tmp_path, ci_fault_hooks=value)).validate()


def test_fault_hooks_change_neither_the_config_hash_nor_what_a_resume_compares(tiny_hf_checkpoint, tmp_path):
    from loop_helpers import small_run_kwargs

    from miles_platform.config import RunConfig, config_changes, saved_config

    a = RunConfig(**small_run_kwargs(tiny_hf_checkpoint, tmp_path)).validate()
    hooks = '[{"hook_name": "save_end", "action": {"kind": "kill_process"}}]'
    b = RunConfig(**small_run_kwargs(tiny_hf_checkpoint, tmp_path, ci_fault_hooks=hooks)).validate()
    assert a.config_hash() == b.config_hash()
    assert config_changes(json.loads(saved_config(b)), a) == []


def test_rank_hooks_fire_only_in_their_ranks_and_the_driver_names_those_due():
    from miles_platform.fault_hooks import RANK_HOOKS

    reqs = parse_fault_hooks(json.dumps([
        {"request_id": "k", "hook_name": "trainer_step_before_allreduce", "action": {"kind": "raise"},
         "rollout_id": 1, "target": {"rank": 1}},
        {"request_id": "g", "hook_name": "trainer_weight_update_before_all_gather", "action": {"kind": "observe"}},
        {"request_id": "d", "hook_name": "save_end", "action": {"kind": "observe"}},
    ]))  # fmt: skip
    logged = []
    driver, rank0, rank1 = (FaultHooks(reqs, logged.append, rank=r) for r in (None, 0, 1))
    assert [r.request_id for r in driver.requests] == ["d"]  # the driver never fires a rank hook
    assert [r.request_id for r in rank0.requests] == ["g"] and [r.request_id for r in rank1.requests] == [
        "k",
        "g",
    ]
    for h in (driver, rank0, rank1):
        h.rollout_id = 1
    driver.fire("trainer_step_before_allreduce")
    rank0.fire("trainer_step_before_allreduce")  # targets rank 1 only
    with pytest.raises(FaultInjected):
        rank1.fire("trainer_step_before_allreduce")
    assert logged == [
        "[ci-fault-hooks] k: raise at trainer_step_before_allreduce, rollout 1 in TrainerActor rank 1"
    ]
    assert [r.describe() for r in driver.due_in_ranks()] == [
        "k (raise at trainer_step_before_allreduce, rollout 1)", "g (observe at trainer_weight_update_before_all_gather)"]  # fmt: skip
    driver.rollout_id = 2
    assert [r.request_id for r in driver.due_in_ranks()] == ["g"]
    assert set(RANK_HOOKS).isdisjoint(HOOKS)
    for bad, match in [
        ({"hook_name": "save_end", "target": {"rank": 0}}, "runs in the driver"),
        ({"hook_name": "trainer_step_before_allreduce", "target": {"cell_id": "c"}}, "no cells"),
        (
            {"hook_name": "trainer_step_before_allreduce", "target": {"rank": -1}},
            "rank must be an integer >= 0",
        ),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_fault_hooks([{**bad, "action": {"kind": "kill_process"}}])


def test_the_send_hook_is_refused_where_no_rank_sends(tiny_hf_checkpoint, tmp_path):
    from loop_helpers import small_run_config

    from miles_platform.preflight import validate_before_start

    hooks = json.dumps([{"request_id": "s", "hook_name": "trainer_weight_update_before_send",
                         "action": {"kind": "kill_process"}}])  # fmt: skip
    validate_before_start(small_run_config(tiny_hf_checkpoint, tmp_path, ci_fault_hooks=hooks,
                                           update_weight_transfer_mode="broadcast"))  # fmt: skip
    for mode in ("tensor", "mooncake"):
        with pytest.raises(ConfigError, match=f"--ci-fault-hooks s: .*broadcast.*'{mode}'"):
            validate_before_start(small_run_config(tiny_hf_checkpoint, tmp_path, ci_fault_hooks=hooks,
                                                   update_weight_transfer_mode=mode))  # fmt: skip
    assert not (tmp_path / "root").exists()


def test_engine_targets_parse_and_are_refused_where_no_engine_process_is_the_runs(
    tiny_hf_checkpoint, tmp_path
):
    from loop_helpers import small_run_config

    from miles_platform.preflight import validate_before_start

    req = {"request_id": "e", "hook_name": "metrics_recorded", "action": {"kind": "stop_process"},
           "rollout_id": 2, "target": {"engine": 1}}  # fmt: skip
    (r,) = parse_fault_hooks([req])
    assert (r.engine, r.rank) == (1, None)
    assert r.describe() == "e (stop_process of engine 1 at metrics_recorded, rollout 2)"
    calls = []
    hooks = FaultHooks([r], calls.append)
    hooks.on_engine = lambda q: calls.append(("engine", q.engine))
    hooks.rollout_id = 2
    hooks.fire("metrics_recorded")  # the driver does not stop itself: the engine's action runs
    assert calls == [
        "[ci-fault-hooks] e: stop_process of engine 1 at metrics_recorded, rollout 2",
        ("engine", 1),
    ]
    for bad, match in [
        ({**req, "action": {"kind": "sleep", "seconds": 1}}, "action 'sleep' on an engine; choose one of"),
        ({**req, "action": {"kind": "exit_process"}}, "action 'exit_process' on an engine; choose one of"),
        (
            {**req, "hook_name": "trainer_step_before_allreduce"},
            "target names an engine; .* runs in a trainer rank",
        ),
        ({**req, "target": {"engine": -1}}, "target engine must be an integer >= 0"),
        ({**req, "target": {"engine": 0, "rank": 0}}, "target must be"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_fault_hooks([bad])
    hooks_json = json.dumps([req])
    validate_before_start(
        small_run_config(tiny_hf_checkpoint, tmp_path, rollout_num_gpus=2, ci_fault_hooks=hooks_json)
    )
    with pytest.raises(
        ConfigError, match=r"--ci-fault-hooks e: engine 1, but the run has 1 engine\(s\) \(0..0\)"
    ):
        validate_before_start(small_run_config(tiny_hf_checkpoint, tmp_path, ci_fault_hooks=hooks_json))
    with pytest.raises(ConfigError, match="--ci-fault-hooks e: an engine target .* has none"):
        validate_before_start(small_run_config(tiny_hf_checkpoint, tmp_path, ci_fault_hooks=hooks_json,
                                               rollout_external_engine_addrs=["127.0.0.1:1"],
                                               update_weight_transfer_mode="disk"))  # fmt: skip
    assert not (tmp_path / "root").exists()
