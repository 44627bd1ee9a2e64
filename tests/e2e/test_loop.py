"""The sync loop end to end on Ray: real engines over HTTP, trainer actor, shards, versions, resume."""

import contextlib
import json
import os
import re

import httpx
import pytest
import torch
from loop_helpers import small_run_config, write_prompts

from miles_platform.config import ConfigError, RunConfig
from miles_platform.loop import Reporter, train, validate_before_start
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths


def _data(tmp_path):
    return write_prompts(tmp_path)


def _cfg(ckpt, tmp_path, **kw):
    return small_run_config(ckpt, tmp_path, **{"ci_test": True, "save_interval": 1, **kw})


class _Logs(Reporter):
    def __init__(self):
        self.lines: list[str] = []

    def log(self, msg: str) -> None:
        self.lines.append(msg)


class _HijackProbe(Reporter):
    """At the first rollout, tries what any local process could: swap the run's weights."""

    def __init__(self):
        self.urls, self.statuses, self.binds = [], [], {}
        self._before = _not_the_runs()

    def log(self, msg: str) -> None:
        if msg.startswith("engines "):
            self.urls = re.findall(r"http://127\.0\.0\.1:\d+", msg)

    def on_rollout(self, rollout_id, metrics) -> None:
        if rollout_id == 0:
            body = {"model_path": "/tmp", "weight_version": 999}
            self.statuses = [
                httpx.post(f"{u}/update_weights_from_disk", json=body, timeout=10).status_code
                for u in self.urls
            ]
            self.binds = _listeners_of_this_process_tree(skip=self._before)


def _listeners_of_this_process_tree(skip: frozenset = frozenset()) -> dict[tuple[str, int], set[str]]:
    """What `ss -ltnp` lists for this driver and every process under it (Ray's GCS, raylet, agents
    and workers, the fork server's actors, our engines and router): {(name, port): addresses}
    (a port can listen on 127.0.0.1 and `::` at once), an IPv4-mapped IPv6 address
    (`::ffff:127.0.0.1`) written as the IPv4 one it is. `skip`: (pid, port) pairs to leave out."""
    import ipaddress

    out: dict[tuple[str, int], set[str]] = {}
    for (pid, name), port, ip in _listening():
        if (pid, port) not in skip:
            ip = ipaddress.ip_address(ip)
            out.setdefault((name, port), set()).add(str(getattr(ip, "ipv4_mapped", None) or ip))
    return out


def _listening() -> list[tuple[tuple[int, str], int, str]]:
    import psutil

    me = psutil.Process()
    tree = {me.pid: me.name()}
    for p in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            tree[p.pid] = p.name()
    return [((c.pid, tree[c.pid]), c.laddr.port, c.laddr.ip) for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in tree]  # fmt: skip


def _not_the_runs() -> frozenset:
    """Listeners up before the run that are not Ray's (the run may join the pytest worker's shared
    Ray, whose servers count): a session fixture's server (mooncake_master's metrics port is on
    0.0.0.0), a TCPStore an earlier test of this worker left behind."""
    import psutil

    def rays(pid: int) -> bool:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            return (
                p.name() in ("gcs_server", "raylet")
                or p.name().startswith("ray::")
                or any("/ray/" in a for a in p.cmdline()[:2])
            )
        return False

    return frozenset((pid, port) for (pid, _), port, _ in _listening() if not rays(pid))


def _check_hooks(cfg, backend: str, paths: StoragePaths) -> None:
    """What each hook saw: every rollout's groups with the data source; on megatron the rank's init, a
    before-step call per optimizer step with megatron's chunks, a post-save call per complete checkpoint."""
    calls = [json.loads(line) for line in open(os.path.join(cfg.storage_root, "hooks.jsonl"))]
    by = lambda name: [c for c in calls if c["hook"] == name]  # noqa: E731
    assert [c["groups"] for c in by("all_samples")] == [[2, 2], [2, 2]]
    if backend != "megatron":
        assert {c["source"] for c in by("all_samples")} == {"CustomDataSource"}
        assert [(c["rollout_id"], c["offset"]) for c in by("data_source_save")] == [(0, 2), (1, 4)]
        assert not by("megatron_init")
        return
    assert {c["source"] for c in by("all_samples")} == {"RolloutDataSource"}
    assert [c["tp"] for c in by("megatron_init")] == [1]  # once per rank, not for the reference
    steps = by("megatron_before_step")
    assert [(c["rollout_id"], c["step_id"]) for c in steps] == [(0, 0), (1, 0)]
    assert steps[0]["model"] == ["GPTModel"] and steps[0]["optimizer"] == "AdamW"
    saves = by("megatron_post_save")
    assert [(c["rollout_id"], c["complete"], c["hf_written"]) for c in saves] == [
        (0, True, True),
        (1, True, True),
    ]
    assert saves[1]["checkpoint_dir"] == os.path.join(paths.checkpoints("t"), "iter_0000001")
    assert saves[1]["hf_checkpoint_dir"] == cfg.save_hf.format(rollout_id=1)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_loop_runs_versions_shards_checkpoints_and_resumes(
    tiny_hf_checkpoint, tmp_path, backend, mooncake_master
):
    # megatron also samples at T 0.7 from a top-k 8 / top-p 0.9 support (sampling-support replay)
    sampling = (
        dict(rollout_temperature=0.7, rollout_top_k=8, rollout_top_p=0.9) if backend == "megatron" else {}
    )
    # customization hooks (tests/hook_fns.py; each logs to <root>/hooks.jsonl) and the eval gate
    megatron_hooks = dict(custom_megatron_init_path="hook_fns.megatron_init",
                          custom_megatron_before_train_step_hook_path="hook_fns.megatron_before_train_step",
                          custom_megatron_post_save_hook_path="hook_fns.megatron_post_save",
                          # the trainer ranks import the hooks as a user's ranks would: from their PYTHONPATH
                          train_env_vars=json.dumps({"PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}))  # fmt: skip
    sampling.update(rollout_all_samples_process_path="hook_fns.all_samples_process",
                    **(megatron_hooks if backend == "megatron" else {}))  # fmt: skip
    if backend == "fsdp":  # Miles' DataSource contract over the same prompts (its save / load logged)
        sampling["data_source_path"] = "hook_fns.JsonlDataSource"
    gate = dict(
        ci_metric_checker_key="eval/heldout/pass@1",
        ci_metric_checker_threshold=0.0,
        ci_metric_checker_expect_num=2,
    )  # v0 and v2 report it
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, train_backend=backend, eval_interval=2, **sampling, **gate,
               eval_prompt_data=["heldout", _data(tmp_path)], save_hf=str(tmp_path / "hf" / "iter_{rollout_id}"),
               log_passrate=True, use_rollout_entropy=backend == "megatron")  # fmt: skip
    rep = _HijackProbe()
    res = train(cfg, rep)
    # a default run (no --api-key) is closed to other local processes: the weight-swap hijack of
    # issue 19, sent without the run's secret to the router and the engine, is refused
    assert rep.statuses and set(rep.statuses) == {401}, rep.statuses
    # `ss -ltnp` during the run: every listener of the run, Ray's own included, is on 127.0.0.1
    ports = {port for _, port in rep.binds}
    assert {int(u.rsplit(":", 1)[1]) for u in rep.urls} <= ports and len(rep.urls) >= 2, (rep.urls, rep.binds)
    assert {"gcs_server", "raylet"} <= {name for name, _ in rep.binds}, rep.binds
    assert not {k: ips for k, ips in rep.binds.items() if ips != {"127.0.0.1"}}, rep.binds
    assert "eval/heldout/pass@1" in res.metrics[1] and "eval/heldout/pass@1" not in res.metrics[0]
    assert os.path.exists(tmp_path / "hf" / "iter_1" / "model.safetensors")
    assert res.final_version == 2 and len(res.versions) == 2
    assert res.ci_checks["step0_ppo_kl"] < 1e-9
    assert res.ci_checks["train_rollout_logprob_abs_diff"] < 1e-3
    paths = StoragePaths(cfg.storage_root)
    cols, rows = Catalog(paths).query("select rollout_id, count(*) from rollouts group by 1 order by 1")
    assert rows == [(0, 4), (1, 4)]
    _, sup = Catalog(paths).query("select rollout_sampling_support, response_tokens from rollouts")
    for support, resp in sup:
        assert (support is None) == (backend == "fsdp")
        if support is not None:
            assert len(support) == len(resp) and all(t in s and len(s) <= 8 for t, s in zip(resp, support))
    _, pv = Catalog(paths).query("select version, parent_version from policy_versions order by 1")
    assert pv == [(1, 0), (2, 1)]
    _check_train_samples(Catalog(paths))
    _check_miles_metrics(Catalog(paths), res.metrics)
    # eval before train (Miles: unless --skip-eval-before-train): the initial policy is version 0
    evals = "select version, partition_key, dataset from evals where metric = 'pass@1' order by version"
    _, ev = Catalog(paths).query(evals)
    assert ev == [(0, "t.v000000", "heldout"), (2, "t.v000002", "heldout")]
    # each row names its writer and the sampling it used (eval inherits the rollout's)
    _, src = Catalog(paths).query(
        "select distinct source, temperature, top_p, top_k, max_new_tokens from evals where metric like '%(T=%'"
    )
    _, greedy = Catalog(paths).query(
        "select distinct source, n_samples, temperature, top_p, top_k, max_new_tokens from evals where metric = 'pass@1' or metric like 'pass@1/%'"
    )
    assert greedy == [("loop", 1, 0.0, 1.0, -1, 4)]  # pass@1 is the greedy answer
    want = (
        sampling.get("rollout_temperature", 1.0),
        sampling.get("rollout_top_p", 1.0),
        sampling.get("rollout_top_k", -1),
    )
    assert src == [("loop", *want, 4)]
    assert 0.0 <= res.eval_before_train["eval/heldout/pass@1"] <= 1.0
    assert os.path.exists(os.path.join(paths.checkpoints("t"), "latest_checkpointed_iteration.txt"))
    if backend == "fsdp":  # v2's export came back with rollout 1's train call: the trainer's weights after it
        from safetensors.torch import load_file

        exported = load_file(os.path.join(paths.hf_export("t", 2), "model.safetensors"))
        saved = load_file(os.path.join(paths.checkpoints("t"), "iter_0000001", "model.safetensors"))
        assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    _check_hooks(cfg, backend, paths)
    # relaunching the same command with more rollouts resumes at rollout 2, version 2; no second v0 eval
    cfg2 = _cfg(tiny_hf_checkpoint, tmp_path, num_rollout=3, train_backend=backend, eval_interval=2, **sampling,
                eval_prompt_data=["heldout", _data(tmp_path)])  # fmt: skip
    res2 = train(cfg2)
    assert res2.start_rollout_id == 2 and res2.final_version == 3
    if backend == "fsdp":  # the resume loaded the data source at the checkpoint's rollout
        loads = [json.loads(x) for x in open(os.path.join(cfg.storage_root, "hooks.jsonl")) if "_load" in x]
        assert [c["rollout_id"] for c in loads] == [1]
    assert Catalog(paths).query(evals)[1] == ev
    _, rows = Catalog(paths).query("select distinct rollout_id from rollouts order by 1")
    assert [r[0] for r in rows] == [0, 1, 2]
    _, ts = Catalog(paths).query(
        "select rollout_id, version, status, count(*) from train_samples group by all order by 1"
    )
    assert ts == [(0, 1, "committed", 4), (1, 2, "committed", 4), (2, 3, "committed", 4)]


def _check_miles_metrics(cat: Catalog, metrics: list[dict]) -> None:
    """--log-passrate's passrate/pass@1 and pass@2 of each rollout's groups of 2 (from the rollouts
    table), the trainer's rollout/* (its log-probs before the step agree with the engine's: the same
    weights) and perf/train_wait_time."""
    _, rows = cat.query(
        "select rollout_id, group_index, sum((raw_reward = 1)::int) from rollouts group by 1, 2 order by 1, 2"
    )
    for rid in (0, 1):
        correct = [c for r, _, c in rows if r == rid]
        m = metrics[rid]
        assert m["passrate/pass@1"] == pytest.approx(sum(correct) / (2 * len(correct)))
        assert m["passrate/pass@2"] == pytest.approx(sum(c > 0 for c in correct) / len(correct))
        assert abs(m["rollout/log_probs"] - m["rollout/rollout_log_probs"]) < 1e-3
        assert m["rollout/entropy"] > 0 and m["perf/train_wait_time"] > 0
        # the driver's own share of the step, beside the rollout, the trainer and the engines' update
        # (the shard is written while the train call runs: timed, not in the sequential sum)
        driver = ["perf/get_weights_time", "perf/export_hf_time", "perf/record_version_time"]
        assert all(m[k] > 0 for k in [*driver, "perf/rollout_shard_time"]), m
        parts = m["perf/rollout_time"] + m["perf/actor_train_time"] + m["perf/update_weights_time"]
        assert parts + sum(m[k] for k in driver) < m["perf/rollout_total_time"]


def _check_train_samples(cat: Catalog) -> None:
    """A train_samples row per trained sample, joined to its rollout row: the version its step made,
    step 0's trainer log-probs equal to the engine's (both fp32 on CPU, the same weights), and
    GRPO's advantage of the rollout's rewards on every token."""
    import statistics

    _, rows = cat.query(
        "select rollout_id, index, group_index, version, step, raw_reward, advantage, log_probs, "
        "t.rollout_log_probs, r.rollout_log_probs, t.loss_mask, ratio, clipped, response_length "
        "from train_samples t join rollouts r using (run, rollout_id, index) order by rollout_id, index"
    )
    assert [(r[0], r[1], r[3], r[4]) for r in rows] == [
        (rid, i, rid + 1, rid) for rid in (0, 1) for i in range(4)
    ]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r[0], r[2]), []).append(r[5])
    for rid, _, gi, _, step, reward, adv, lp, t_rlp, rlp, mask, ratio, clipped, n in rows:
        assert len(adv) == len(lp) == len(ratio) == len(clipped) == len(mask) == n and t_rlp == pytest.approx(
            rlp
        )
        g = groups[(rid, gi)]
        std = statistics.stdev(g)
        want = (reward - statistics.mean(g)) / (std + 1e-6) if std > 0 else reward - statistics.mean(g)
        assert adv == pytest.approx([want] * n, abs=1e-6)
        if step == 0:
            assert max(abs(a - b) for a, b in zip(lp, rlp)) < 1e-3, (lp, rlp)
            assert ratio == pytest.approx([1.0] * n, abs=1e-5) and not any(clipped)
    # the local cluster's raylet starts every worker through our stdlib setup script (not Ray's,
    # which imports Ray: ~0.45 CPU-s per actor start)
    import ray

    from miles_platform.cluster import setup_worker

    node = ray._private.worker.global_worker.node
    assert node._ray_params.setup_worker_path == os.path.abspath(setup_worker.__file__)


def test_bad_config_fails_before_any_engine_starts(tiny_hf_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="rm-type"):
        validate_before_start(_cfg(tiny_hf_checkpoint, tmp_path, rm_type="nope"))
    with pytest.raises(ConfigError, match="custom-rm-path"):
        validate_before_start(_cfg(tiny_hf_checkpoint, tmp_path, custom_rm_path="no.such.module.fn"))
    with pytest.raises(ConfigError, match="global-batch-size"):
        RunConfig(rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=3).validate()
    # --sglang-* flags: the embedded engine honours max-running-requests and mem-fraction-static
    # (its KV budget) and refuses the rest
    with pytest.raises(ConfigError, match="sglang-enable-dp-attention.*embedded engine"):
        validate_before_start(_cfg(tiny_hf_checkpoint, tmp_path, sglang_args={"enable-dp-attention": True}))
    with pytest.raises(ConfigError, match="sglang-mem-fraction-static '1.5': must be a number in"):
        validate_before_start(_cfg(tiny_hf_checkpoint, tmp_path, sglang_args={"mem-fraction-static": "1.5"}))
    validate_before_start(_cfg(tiny_hf_checkpoint, tmp_path, sglang_args={"mem-fraction-static": "0.7"}))
    with pytest.raises(ConfigError, match="sglang-max-running-requests"):
        validate_before_start(_cfg(tiny_hf_checkpoint, tmp_path, sglang_args={"max-running-requests": "0"}))
    validate_before_start(_cfg(tiny_hf_checkpoint, tmp_path, sglang_args={"max-running-requests": "8"}))


def test_mooncake_handoff_and_weight_transport(tiny_hf_checkpoint, tmp_path, mooncake_master, monkeypatch):
    """Rollout data and weights both go through a real Mooncake store over TCP on loopback."""
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    flag = json.dumps({"protocol": "tcp", "master_server_address": mooncake_master, "local_hostname": "127.0.0.1",
                       "global_segment_size": "64mb", "local_buffer_size": "64mb"})  # fmt: skip
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, object_store_backend="mooncake", mooncake_store_init_kwargs=flag,
               update_weight_transfer_mode="mooncake", check_weight_update_equal=True)  # fmt: skip
    res = train(cfg)
    assert res.final_version == 2
    assert all(m["perf/update_weights_wire_bytes"] > 0 for m in res.metrics)


def test_disk_delta_weights_and_fully_async(tiny_hf_checkpoint, tmp_path):
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, update_weight_transfer_mode="disk-delta",
               update_weight_disk_dir=str(tmp_path / "pub"), fully_async=True, max_weight_staleness=4,
               check_weight_update_equal=True, ci_test=False, eval_prompt_data=["heldout", _data(tmp_path)],
               eval_interval=4, skip_eval_before_train=True,
               custom_update_weight_post_write_path="loop_helpers.record_post_write")  # fmt: skip
    res = train(cfg)
    assert res.final_version == 2
    # eval is configured (next due at v4), and --skip-eval-before-train skipped the eval of v0
    assert Catalog(StoragePaths(cfg.storage_root)).query("select count(*) from evals")[1] == [(0,)]
    from miles_platform.weights.disk_delta import committed_versions

    assert committed_versions(str(tmp_path / "pub")) == [0, 1, 2]  # base snapshot, then one per update
    m = res.metrics[-1]  # Miles' names
    assert {"rollout/fully_async/max_staleness", "rollout/fully_async/queue_size",
            "rollout/fully_async/avg_generation_version_span"} <= set(m)  # fmt: skip
    # the checkpoint after rollout 0 accounts for every prompt handed out: trained in rollout 0, in
    # flight (saved as pending, served first on resume), or generated and buffered (saved as groups,
    # restored as they are): none lost, none twice
    from collections import Counter

    save = StoragePaths(cfg.storage_root).checkpoints("t")
    with open(os.path.join(save, "iter_0000000", "trainer_state.json")) as f:
        state = json.load(f)
    ds, buf = state["data_source"], state["async_data_buffer"]
    from miles_platform.data.dataset import load_prompt_dataset

    order = [r.id for r in load_prompt_dataset(cfg.prompt_data, input_key="prompt", label_key="label")]
    handed_out = Counter(order * ds["epoch"] + order[: ds["offset"]])
    _, rows = Catalog(StoragePaths(cfg.storage_root)).query(
        "select json_extract_string(metadata, '$.prompt_id') from rollouts where rollout_id = 0 and index % 2 = 0"
    )
    trained = Counter(r[0] for r in rows)
    pending = Counter(r["id"] for r in ds.get("pending", []))
    buffered = Counter(e["prompt"]["id"] for e in buf["buffer"]["entries"] + buf["finished"])
    assert sum(pending.values()) + sum(buffered.values()) > 0
    assert trained + pending + buffered == handed_out, (trained, pending, buffered, handed_out)
    # the post-write hook saw each version once, committed, before the engines pulled it
    with open(f"{cfg.update_weight_disk_dir}.post_write_hook.jsonl") as f:
        calls = [json.loads(line) for line in f]
    assert calls == [
        {"dir": f"weight_v{v:06d}", "latest": v, "exists": True, "engines": 1} for v in (0, 1, 2)
    ]


def test_debug_rollout_data_roundtrip_fsdp2_two_ranks(tiny_hf_checkpoint, tmp_path):
    """Rollout-only with dynamic sampling saves Parquet rollouts; train-only replays them on 2 FSDP2 ranks."""
    dump = str(tmp_path / "debug" / "rollout_{rollout_id}.parquet")
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, debug_rollout_only=True, save_debug_rollout_data=dump,
               rm_type="random", n_samples_per_prompt=4, global_batch_size=8, over_sampling_batch_size=4,
               dynamic_sampling_filter_path="miles_platform.rollout.filter_hub.check_reward_nonzero_std")  # fmt: skip
    res = train(cfg)
    assert res.last_rollout_id == 1 and os.path.exists(dump.format(rollout_id=1))
    cfg2 = _cfg(tiny_hf_checkpoint, tmp_path, load_debug_rollout_data=dump, n_samples_per_prompt=4,
                global_batch_size=8, actor_num_gpus_per_node=2, use_dynamic_batch_size=True, max_tokens_per_gpu=24,
                run_name="replay", ci_test=False,
                save_debug_train_data=str(tmp_path / "debug" / "train_{rollout_id}_{rank}.parquet"))  # fmt: skip
    res2 = train(cfg2)
    assert len(res2.metrics) == 2 and all(m["train/grad_norm"] > 0 for m in res2.metrics)
    # each rank's train_samples rows land (no versions without engines), and its debug file
    _, ts = Catalog(StoragePaths(cfg.storage_root)).query(
        "select rollout_id, rank, count(distinct index), count(version) from train_samples "
        "where run = 'replay' group by all order by 1, 2"
    )
    assert ts == [(0, 0, 4, 0), (0, 1, 4, 0), (1, 0, 4, 0), (1, 1, 4, 0)]
    assert all(os.path.exists(tmp_path / "debug" / f"train_{r}_{k}.parquet") for r in (0, 1) for k in (0, 1))


def test_a_bad_post_write_hook_fails_before_anything_starts(tiny_hf_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="custom-update-weight-post-write-path"):
        validate_before_start(
            _cfg(tiny_hf_checkpoint, tmp_path, custom_update_weight_post_write_path="loop_helpers.nope")
        )
    with pytest.raises(ConfigError, match="custom-update-weight-post-write-path"):  # takes 3 arguments
        validate_before_start(
            _cfg(
                tiny_hf_checkpoint,
                tmp_path,
                custom_update_weight_post_write_path="loop_helpers.write_prompts",
            )
        )


def test_miles_flag_names_for_delta_encoding_and_checksum():
    from miles_platform.config import parse_run_config

    cfg = parse_run_config(["--rollout-batch-size", "2", "--update-weight-delta-encoding", "overwrite",
                            "--update-weight-delta-checksum", "blake3"])  # fmt: skip
    assert (cfg.disk_delta_encoding, cfg.disk_delta_checksum) == ("overwrite", "blake3")
    assert (
        RunConfig.from_dict({"update-weight-delta-encoding": "overwrite"}).disk_delta_encoding == "overwrite"
    )
    with pytest.raises(ConfigError, match="same flag with different values"):
        RunConfig.from_dict({"update_weight_delta_encoding": "overwrite", "disk_delta_encoding": "xor"})


def test_flags_not_built_are_refused_not_ignored():
    with pytest.raises(ConfigError, match="tensor-model-parallel-size"):
        RunConfig(rollout_batch_size=2, tensor_model_parallel_size=2).validate()


def test_resume_after_a_crash_never_reuses_a_version_key(tiny_hf_checkpoint, tmp_path):
    """Versions made after the last checkpoint survive a crash; the resumed run branches from the checkpoint.
    The trackers follow it (one wandb run, each TensorBoard step once) and both launches leave one
    file per table (compacted when each ended). Both launch as `train-async` (Miles' one-step overlap):
    rollout k is generated by v(k-1), a launch's first two by its start version, with the prompts of a
    sync run; the checkpoint at rollout 1, saved while rollout 2 generated, resumes with rollout 2's."""
    pytest.importorskip("wandb", reason="the `trackers` extra is not installed")
    from miles_platform.store.paths import TABLES
    from miles_platform.store.tables import list_files
    from miles_platform.trackers import WANDB_RUN

    trackers = dict(use_tensorboard=True, tensorboard_dir=str(tmp_path / "tb"), use_wandb=True,
                    wandb_mode="offline", wandb_dir=str(tmp_path / "wb"))  # fmt: skip
    # where each train begins and ends (the hooks change nothing trained: the relaunch drops them)
    seen = [{"request_id": f"{h}{k}", "hook_name": h, "action": {"kind": "observe"}, "rollout_id": k}
            for h in ("trainer_controller_step_start", "trainer_controller_step_end") for k in (0, 1, 2)]  # fmt: skip
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, num_rollout=3, save_interval=2, ci_test=False, train_async=True,
               ci_fault_hooks=json.dumps(seen), **trackers)  # fmt: skip
    logs = _Logs()
    first = train(cfg, logs)  # versions 1, 2, 3; checkpoints at rollout 1 (v2) and rollout 2 (v3, the last)
    # the pipeline: rollout 1 (generated while 0 trained) queued its train before rollout 0's ended;
    # rollout 2 waited for rollout 1's checkpoint, which must hold rollout 1's weights
    order = [
        re.search(r"\] (\w+?)(\d): observe", line).groups() for line in logs.lines if ": observe at " in line
    ]
    assert [f"{h.removeprefix('trainer_controller_')}{k}" for h, k in order] == [
        "step_start0",
        "step_start1",
        "step_end0",
        "step_end1",
        "step_start2",
        "step_end2",
    ], order
    assert [("perf/rollout_wait_time" in m) for m in first.metrics] == [
        True,
        True,
        True,
    ]  # waited at each update
    paths = StoragePaths(cfg.storage_root)
    from miles_platform.data.source import RolloutDataSource

    src = RolloutDataSource.from_config(cfg)
    sync_prompts = [sorted(r.prompt for r in src.get_samples(cfg.rollout_batch_size)) for _ in range(3)]
    rollouts = (
        "select rollout_id, list(distinct prompt order by prompt), list(distinct weight_version_start), "
    )
    rollouts += "list(distinct weight_version_end), count(*) from rollouts group by 1 order by 1"
    _, got = Catalog(paths).query(rollouts)
    assert got == [(k, sync_prompts[k], [v], [v], 4) for k, v in enumerate([0, 0, 1])]
    files = {t: len(list_files(paths, t, "t")) for t in TABLES}  # no evals here; a resume: its event
    assert files == {
        "policy_versions": 1,
        "evals": 0,
        "lineage": 1,
        "metrics": 1,
        "run_events": 0,
        "train_samples": 1,
    }
    save = paths.checkpoints("t")
    wandb_id = json.loads(open(os.path.join(save, WANDB_RUN)).read())["id"]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")  # as if the run had crashed before saving rollout 2: v3 exists, its checkpoint does not
    # relaunched with another learning rate, allowed: the change is recorded with the resume; and with
    # the trainer on a core of its own (--pin-trainer-cpus, a resumable flag; 2 cores here)
    pin, cores = len(os.sched_getaffinity(0)) >= 2, os.sched_getaffinity(0)
    logs = _Logs()
    res = train(_cfg(tiny_hf_checkpoint, tmp_path, num_rollout=3, save_interval=2, ci_test=False, lr=2e-3,
                     allow_config_change=True, train_async=True, pin_trainer_cpus=pin, **trackers), logs)  # fmt: skip
    assert res.start_rollout_id == 2 and res.final_version == 4
    if pin:  # each rank reports its cores; the driver (this process) gets all of its own back
        first, *rest = sorted(cores)
        want = f"[pin-trainer-cpus] trainer rank cores [[{first}]]; the engines and this driver on {rest}"
        assert want in logs.lines, [line for line in logs.lines if "pin" in line]
        assert os.sched_getaffinity(0) == cores
    # rollout 2 again, from the checkpoint's prompts (none skipped), generated by the checkpoint's v2
    assert Catalog(paths).query(rollouts)[1] == [*got[:2], (2, sync_prompts[2], [2], [2], 4)]
    assert {t: len(list_files(paths, t, "t")) for t in TABLES} == files | {"run_events": 1}
    offline = sorted(p.name for p in (tmp_path / "wb").glob("wandb/offline-run-*"))
    assert len(offline) == 2 and all(n.endswith(f"-{wandb_id}") for n in offline), offline  # one wandb run
    acc = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    tb = acc.EventAccumulator(str(tmp_path / "tb"), size_guidance={acc.SCALARS: 0})
    tb.Reload()
    loss = [(e.step, e.value) for e in tb.Scalars("train/loss")]
    assert [step for step, _ in loss] == [0, 1, 2]  # rollout 2 once: the relaunch's
    assert loss[2][1] == pytest.approx(res.metrics[-1]["train/loss"], rel=1e-6)
    cat = Catalog(paths)
    _, rows = cat.query(
        "select version, parent_version, rollout_id, status from policy_versions order by version"
    )
    # v3 was made after the checkpoint the resume started from: abandoned, its number never reused
    assert rows == [
        (1, 0, 0, "committed"),
        (2, 1, 1, "committed"),
        (3, 2, 2, "abandoned"),
        (4, 2, 2, "committed"),
    ]
    _, m = cat.query(
        "select rollout_id, status, count(*) from metrics where name = 'train/loss' group by 1, 2 order by 1, 2"
    )
    assert m == [(0, "committed", 1), (1, "committed", 1), (2, "abandoned", 1), (2, "committed", 1)]
    # the killed process's rows of rollout 2 (for v3) stay, abandoned; the relaunch's are committed
    _, ts = cat.query(
        "select rollout_id, version, status, count(*) from train_samples group by all order by 1, 2"
    )
    assert ts == [
        (0, 1, "committed", 4),
        (1, 2, "committed", 4),
        (2, 3, "abandoned", 4),
        (2, 4, "committed", 4),
    ]
    _, ev = cat.query("select rollout_id, version, detail from run_events where event = 'resume'")
    assert [(r, v) for r, v, _ in ev] == [(1, 2)]
    detail = json.loads(ev[0][2])
    assert detail["abandoned_versions"] == [3] and detail["config_changes"] == ["--lr 0.001 -> 0.002"]
    # and in lineage: the first version after the change names the config it changed from
    _, edges = cat.query(
        "select child, parent, data_version from lineage where relation = 'config_changed_from'"
    )
    assert edges == [("t.v000004", f"config:{cfg.config_hash()}", cfg.config_hash())]


def test_disk_delta_run_resumes_past_versions_published_after_its_checkpoint(tiny_hf_checkpoint, tmp_path):
    """A crash after v3 was published but before its checkpoint: the publication dir (append-only)
    already holds v3 when the run resumes from v2. The engines get v2 without republishing it, and
    the next version is published as v4 on top of v3; engines equal the trainer after it."""
    from miles_platform.weights.disk_delta import read_index, read_latest

    pub = str(tmp_path / "pub")
    kw = dict(num_rollout=3, save_interval=2, ci_test=False, update_weight_transfer_mode="disk-delta",
              update_weight_disk_dir=pub, check_weight_update_equal=True)  # fmt: skip
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, **kw)
    train(cfg)  # v0 snapshot + v1, v2, v3 published
    assert read_latest(pub) == 3
    save = StoragePaths(cfg.storage_root).checkpoints("t")
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")  # the last checkpoint holds v2
    res = train(_cfg(tiny_hf_checkpoint, tmp_path, **kw))
    assert res.start_rollout_id == 2 and res.final_version == 4
    assert read_latest(pub) == 4 and read_index(pub, 4)["base_version"] == 3


def test_over_sampling_surplus_is_buffered_and_served_by_the_buffer_filter(tiny_hf_checkpoint, tmp_path):
    """Over-sampling keeps 4 groups for a batch of 2: the surplus waits in the buffer and the next rollout
    takes it through --buffer-filter-path instead of generating."""
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, over_sampling_batch_size=4, buffer_filter_path="loop_helpers.newest_first",
               debug_rollout_only=True, ci_test=False)  # fmt: skip
    res = train(cfg)
    assert [m["rollout/buffer_size"] for m in res.metrics] == [2.0, 0.0]
    _, rows = Catalog(StoragePaths(cfg.storage_root)).query(
        "select rollout_id, count(*) filter (where metadata like '%newest_first%') from rollouts group by 1 order by 1"
    )
    assert rows == [(0, 0), (1, 4)]  # rollout 1 = the 2 buffered groups x 2 samples, picked by the filter


def test_every_run_has_a_secret_and_keys_stay_out_of_argv(tiny_hf_checkpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("MILES_API_KEY", raising=False)
    a, b = (_cfg(tiny_hf_checkpoint, tmp_path) for _ in range(2))
    validate_before_start(a)
    validate_before_start(b)
    assert a.api_key and b.api_key and a.api_key != b.api_key and len(a.api_key) >= 32
    assert a.config_hash() == b.config_hash()  # the secret is not part of what is trained
    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    c = _cfg(tiny_hf_checkpoint, tmp_path, api_key_file=str(key_file))
    validate_before_start(c)
    assert c.api_key == "from-a-file"
    monkeypatch.setenv("MILES_API_KEY", "from-env")
    d = _cfg(tiny_hf_checkpoint, tmp_path)
    validate_before_start(d)
    assert d.api_key == "from-env"
    with pytest.raises(ConfigError, match="--api-key-file .*cannot read"):
        validate_before_start(_cfg(tiny_hf_checkpoint, tmp_path, api_key_file=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="give one"):
        validate_before_start(_cfg(tiny_hf_checkpoint, tmp_path, api_key="x", api_key_file=str(key_file)))


def test_one_writer_per_run_and_a_dead_writers_lock_is_taken_over(tiny_hf_checkpoint, tmp_path):
    import subprocess
    import sys

    from miles_platform.loop import RLRun
    from miles_platform.store.run_lock import RunLock, RunLocked

    cfg = _cfg(tiny_hf_checkpoint, tmp_path, num_rollout=1, debug_rollout_only=True, ci_test=False)
    run_dir = StoragePaths(cfg.storage_root).run_dir(cfg.run_name)
    # another process holds the run (a live `train`): the second writer is refused before Ray starts
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from miles_platform.store.run_lock import RunLock; "
         f"RunLock({run_dir!r}, 't').acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=rf"run 't' is being written by pid {holder.pid} on "):
            RLRun(cfg).run()
    finally:
        holder.kill()
        holder.wait()
    # kill -9 freed it: the next writer takes it over, and releases it when done
    with RunLock(run_dir, "t"):
        with pytest.raises(RunLocked):
            RunLock(run_dir, "t").acquire()
    RunLock(run_dir, "t").acquire().release()


def test_a_resume_that_would_train_something_else_is_refused(tiny_hf_checkpoint, tmp_path):
    from miles_platform.config import saved_config
    from miles_platform.loop import RLRun
    from miles_platform.run_lifecycle import check_resume_config

    first = _cfg(tiny_hf_checkpoint, tmp_path, ci_test=False)
    save = StoragePaths(first.storage_root).checkpoints("t")
    os.makedirs(save)
    first.save = save
    with open(os.path.join(save, "run_config.json"), "w") as f:
        f.write(saved_config(first))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    # longer, with evals and more logging: the same run, resumed
    more = _cfg(tiny_hf_checkpoint, tmp_path, ci_test=True, num_rollout=5, eval_interval=2, log_interval=3)
    more.save = save
    check_resume_config(more, print)
    changed = _cfg(tiny_hf_checkpoint, tmp_path, lr=3e-4, rollout_temperature=0.7)
    with pytest.raises(ConfigError, match=r"--lr 0.001 -> 0.0003; --rollout-temperature 1.0 -> 0.7"):
        RLRun(changed).run()  # refused before Ray starts
    allowed = _cfg(tiny_hf_checkpoint, tmp_path, lr=3e-4, allow_config_change=True)
    allowed.save = save
    logs = []
    rep = Reporter()
    rep.log = logs.append
    check_resume_config(allowed, rep.log)
    assert any("--allow-config-change: --lr 0.001 -> 0.0003" in m for m in logs)
    with open(os.path.join(save, "run_config.json")) as f:
        rec = json.load(f)
    assert rec["lr"] == 3e-4 and "api_key" not in rec  # the checkpoint now records this config, no secret


def test_version_numbers_continue_past_every_store_that_knows_one(tiny_hf_checkpoint, tmp_path):
    """kill -9 between publishing (or exporting) v6 and recording it: no catalog row for v6, but
    LATEST and hf/v000006 exist. The resumed run numbers its next version 7, never a second v6."""
    from miles_platform.loop import RLRun
    from miles_platform.run_lifecycle import published_version, remove_dead_writers_tmp
    from miles_platform.store.recorder import recorded_max_version

    pub = tmp_path / "pub"
    cfg = _cfg(
        tiny_hf_checkpoint,
        tmp_path,
        update_weight_transfer_mode="disk-delta",
        update_weight_disk_dir=str(pub),
    )
    cfg.save = StoragePaths(cfg.storage_root).checkpoints("t")
    run = RLRun(cfg)
    assert recorded_max_version(run.paths, "t", published_version(cfg)) == 0
    os.makedirs(run.paths.hf_export("t", 5))
    assert recorded_max_version(run.paths, "t", published_version(cfg)) == 5
    pub.mkdir()
    (pub / "LATEST").write_text("6\n")
    assert recorded_max_version(run.paths, "t", published_version(cfg)) == 6
    # half-written exports / checkpoints of the dead writer are removed at startup (under the lock)
    hf = os.path.dirname(run.paths.hf_export("t", 8))
    junk = [os.path.join(hf, ".v000008.tmp-ab12cd34"), os.path.join(cfg.save, ".iter_0000003.tmp-a1b2c3"),
            str(pub / ".tmp-v000007-0123abcd")]  # fmt: skip
    for j in junk:
        os.makedirs(j)
    keep = os.path.join(cfg.save, "iter_0000002")
    os.makedirs(keep)
    # an atomic file write's staging two levels down (a diffusion eval grid) and a file that only
    # looks alike
    grid = os.path.join(run.paths.run_dir("t"), "evals", "v000003")
    os.makedirs(grid)
    junk_file, keep_file = (
        os.path.join(grid, ".heldout.png.tmp-9f8e7d"),
        os.path.join(grid, "heldout.png.tmp"),
    )
    for f in (junk_file, keep_file):
        open(f, "w").close()
    remove_dead_writers_tmp(cfg, run.paths, print)
    assert not any(os.path.exists(j) for j in [*junk, junk_file]) and os.path.isdir(keep)
    assert os.path.isfile(keep_file)
    assert recorded_max_version(run.paths, "t", published_version(cfg)) == 6


def test_the_train_call_goes_out_before_the_shard_is_on_disk(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """A rollout's shard is written beside its train call (loop.py `_take_rollout`), from the samples
    as taken: a write held 0.5 s ends after the train call was submitted, and a change to the samples
    after the take (what a convert hook may do) is not in the file the version's row names."""
    import time

    from miles_platform.loop import RLRun
    from miles_platform.store import shards

    events = []
    write = shards.write_shard_table

    def slow_write(*a, **kw):
        time.sleep(0.5)
        events.append(("written", a[2], time.monotonic()))
        return write(*a, **kw)

    submit = RLRun._submit_train

    def changing_submit(self, rollout_id, samples, *a, **kw):
        events.append(("submitted", rollout_id, time.monotonic()))
        for s in samples:
            s.reward = 42.0
        return submit(self, rollout_id, samples, *a, **kw)

    monkeypatch.setattr(shards, "write_shard_table", slow_write)
    monkeypatch.setattr(RLRun, "_submit_train", changing_submit)
    res = train(_cfg(tiny_hf_checkpoint, tmp_path, num_rollout=2))
    at = {(kind, rid): t for kind, rid, t in events}
    for rid in (0, 1):
        assert at[("submitted", rid)] < at[("written", rid)]
    cat = Catalog(StoragePaths(str(tmp_path / "root")))
    _, rows = cat.query("select count(*), max(reward) from rollouts")
    assert rows[0][0] == 8 and rows[0][1] != 42.0
    _, versions = cat.query("select shard_path from policy_versions order by version")
    assert len(versions) == 2 and all(os.path.exists(p) for (p,) in versions) and res.final_version == 2
