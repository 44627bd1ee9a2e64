import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_platform.cluster.ports import free_port
from miles_platform.models.tiny import save_tiny_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _share_the_default_tls_context() -> None:
    """The tests' own `httpx.get(...)` / `httpx.post(...)` calls (~150 call sites, some in loops of
    60 fuzzed examples) make a new client each, and httpx builds each one a TLS context from
    certifi's bundle (~40-100 ms of CPU; ~50 CPU-s over test_fuzz.py's two HTTP tests alone) for
    loopback `http://` URLs that never use it. A client of the default verification gets the one
    context the platform's clients share (miles_platform/tls.py: the same verification, built once).
    Clients that pass their own `verify`, as the platform's do, are untouched."""
    import httpx._transports.default as transports

    real = transports.create_ssl_context

    def shared(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            from miles_platform.tls import client_tls

            return client_tls()
        return real(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = shared


_share_the_default_tls_context()


def _exit_without_finalizing() -> None:
    """A pytest-xdist worker's last exit handler (registered before any other of this session's, so it
    runs after them: Ray's shutdown, multiprocessing's): end the process without the interpreter's
    finalization of a heap holding torch, transformers, dagster and Ray, which the controller waits
    on with the machine idle (2-5 s at the end of every run, measured 2026-12-05)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if os.environ.get("PYTEST_XDIST_WORKER"):
    atexit.register(_exit_without_finalizing)


# `make test` runs on pytest-xdist workers with --dist loadfile: a file's tests share its module
# fixtures (an SFT base, a server) on one worker. (--dist loadgroup with xdist_group marks does not
# group under pytest 9.2: xdist 3.8 renames `item._nodeid`, which pytest 9 no longer reads.) The
# longest files go first, so no worker is left with a long file at the end (seconds on 2 cores);
# `make test` passes --no-loadscope-reorder, without which xdist orders files by number of tests.
# The learning tests go late: their SFT bases train in the background from the start on the idle
# cycles (tests/background_bases.py): test_learning.py's (~94 CPU-s) took 250 s of a full run
# (2026-12-06), and the file (~45 s without it) starts after the files of 15 s and more (at 19.5, after
# those of 20 s, it started 249 s in and waited 11 s for its base, done at 260 s: 2026-12-06 20:02 UTC);
# the diffusion assets (~30-40 CPU-s, in test_diffusion_loop.py's setup until 2026-12-06: 32 s of its
# worker's wall) train next, and that file (~45 s without them) goes after those of 10 s and more.
# (The vision-language learning check's base trains only under `make test-extended`.) On a slow VM
# (2026-12-07, a bare SFT step 65 ms against 51) test_learning.py, then at 14.5 with its fsdp case
# only, started 282 s in and waited ~22 s; the diffusion file, at 9.4, 363 s in and ~17 s: both later.
# At 5 the diffusion file still waited ~33 s (381 s into a 596 s run, its assets done at ~415 s: 03:10
# UTC, the VM 1.35x slower than at f7): it now runs among the short files, as if it sat in tests/gpu
# (~445 s in on that run), with ~100 s of short files still to go after it.
LATE = {"test_diffusion_loop.py": "tests/gpu/~"}
LONGEST_FIRST = {  # seconds per file in a full run (2 workers, junit times), 2026-12-06 08:10 UTC
    "test_learning.py": 8.5, "test_cluster_ray.py": 86,
    "test_deepseek_v32_bridge.py": 22, "test_megatron_layouts.py": 41, "test_ui_browser.py": 53,
    "test_crash_matrix.py": 53, "test_fault_tolerance.py": 46, "test_model_families_loop.py": 61,
    "test_loop.py": 36, "test_ui_daily_use.py": 30, "test_ops_training.py": 21,
    "test_megatron_resume.py": 14, "test_kernels.py": 8, "test_sglang_launcher.py": 15,
    "test_diffusion_crash.py": 14, "test_tito.py": 17, "test_compaction.py": 15,
    "test_trainer_fault_hooks.py": 19, "test_opd_loop.py": 8, "test_sft.py": 10,
    "test_engine_control.py": 11, "test_object_store_root.py": 14, "test_deepseek_v3_bridge.py": 21,
    "test_glm4_moe_bridge.py": 16, "test_generate_hub.py": 13,
}  # fmt: skip


# `make test-fast` leaves these out (-m "not slow"): whole training runs, SFT bases, the browser,
# multi-process gloo groups, a Ray cluster or a served engine in a subprocess; each takes over ~3-5 s
# in a full run (--durations, 2026-12-05). `make test` runs everything.
SLOW = {
    # over 2.5 s each in the full run of 2026-12-05 14:00 UTC (make test-fast had reached 125 s):
    "test_job_writes_under_the_storage_resource_root_from_any_working_dir",
    "test_a_tensor_and_data_parallel_lora_step_equals_the_one_rank_step",
    "test_a_kill_9_during_a_megatron_async_save_resumes_from_the_last_complete_checkpoint",
    "test_the_engine_log_is_private_and_never_follows_a_planted_link",
    "test_a_base_checkpoint_with_nan_weights_is_refused_naming_the_tensor",
    "test_pack_kernels_are_compiled_once_per_machine_not_per_process",
    # 2-3 s each in the full run of 2026-12-05 11:33 UTC (make test-fast had reached 124 s):
    "test_prompt_dataset_loader_accepts_or_names_the_problem",
    "test_pause_retract_and_in_place_resume_to_the_same_result",
    "test_the_moe_recipe_with_routing_replay_runs_two_rollouts_through_miles_platform_train",
    "test_same_seed_same_weights_other_seed_differs",
    "test_weight_check_over_http_against_stand_in_sglang",
    "test_a_rank_that_does_not_answer_stops_the_run_by_name",
    "test_attach_external_engine_over_http",
    "test_the_model_id_is_the_absolute_checkpoint_or_the_run_and_version",
    # over ~3 s each in the full run of 2026-12-05 08:40 UTC (make test-fast had reached 131 s):
    "test_a_crash_at_any_step_shows_each_row_once_and_a_rerun_repairs",
    "test_a_quantized_rollout_checkpoint_is_served_quantized_after_every_update",  # 2-rollout runs on Ray
    "test_offload_and_onload_move_every_tensor_and_change_nothing",
    "test_a_second_writer_with_another_cache_dir_is_refused_until_the_first_releases",
    "test_a_store_that_fails_after_torch_took_its_socket_closes_it_once",
    "test_weight_group_joins_to_a_dead_port_are_bounded_and_do_not_pile_up",
    "test_compact_keeps_every_row_and_the_catalog_answers_the_same",
    "test_train_step_runs_on_the_ranks_device",
    "test_an_object_store_root_is_compacted_the_same",
    "test_restarted_publisher_continues_the_chain",
    "test_sft_on_megatron_matches_fsdp", "test_trainer_receives_same_rollout_data_on_both_backends",
    "test_ray_actors_fork_from_the_server_with_their_runtime_env_and_own_rng",
    "test_a_crashing_a_hung_and_a_raising_agent_fail_only_their_own_sample",
    "test_the_control_routes_answer_bad_requests_with_a_4xx_and_the_engine_recovers",
    "test_the_http_api_answers_bad_requests_with_a_4xx_never_a_500",
    "test_lowbits_matches_reference_and_applies", "test_ray_actor_launches_engine_on_rollout_bundle",
    "test_hf_to_torch_dist_to_hf_is_bit_exact_in_the_per_expert_layout",
    "test_cli_serve_engine_serves_and_stops_on_sigterm", "test_convert_reports_its_phases",
    "test_kill_9_of_train_diffusion_then_relaunch_abandons_past_the_checkpoint_and_reuses_no_version",
    "test_dagster_ray_job_outlives_its_run_worker_then_attaches_reconciles_and_cancels",
    "test_train_submit_on_an_s3_root_attaches_streams_and_ctrl_c_stops",
    "test_grpo_lifts_reward_and_heldout_accuracy", "test_grpo_at_tp2_learns_as_at_tp1",
    "test_materialize_eval_results_from_the_ui",
    "test_grpo_with_routing_replay_lifts_an_upcycled_moe",
    "test_asset_graph_shows_pipeline_and_edges", "test_policy_versions_lists_its_partitions",
    "test_over_sampling_surplus_is_buffered_and_served_by_the_buffer_filter",
    "test_debug_rollout_data_roundtrip_fsdp2_two_ranks", "test_converted_checkpoint_and_round_trip_check",
    "test_loop_runs_versions_shards_checkpoints_and_resumes", "test_loop_updates_engines_by_broadcast",
    "test_run_logs_to_wandb_offline_and_tensorboard_and_calls_custom_log_functions",
    "test_disk_delta_weights_and_fully_async", "test_multi_turn_from_the_launchpad_in_a_ci_test_run",
    "test_nested_wrap_units_on_two_gloo_ranks", "test_two_ranks_train_like_one_rank",
    "test_ppo_critic_two_ranks_train_like_one_rank", "test_layout_save_loads_at_one_rank",
    "test_resume_after_a_crash_never_reuses_a_version_key",
    "test_disk_delta_run_resumes_past_versions_published_after_its_checkpoint",
    "test_mooncake_handoff_and_weight_transport", "test_lora_run_syncs_adapters_only_and_resumes",
    "test_lora_version_materializes_lora_adapters_and_points_policy_versions_at_it",
    "test_opd_run_with_ci_test_records_teacher_scores_metrics_and_lineage",
    "test_the_launchpad_runs_opd_and_policy_versions_name_the_teacher", "test_the_in_trainer_teacher_on_the_megatron_backend",
    "test_family_loop_ci_disk_delta_and_resume", "test_grpo_from_a_base_that_counts_4_as_3_lifts_heldout_accuracy", "test_hf_to_torch_dist_to_hf_is_bit_exact",
    "test_megatron_logits_loss_grads_match_hf_in_fp32", "test_without_the_family_mapping_parity_fails",
    "test_without_each_glm_mapping_parity_fails",  # test_glm4_moe_bridge.py's megatron subprocess (~8 s)
    "test_without_each_mapping_parity_fails",  # test_deepseek_v3_bridge.py's parity subprocess (~10-30 s)
    "test_without_each_gpt_oss_mapping_parity_fails",  # test_gpt_oss_bridge.py's megatron subprocess
    "test_without_the_sparse_attention_or_each_indexer_mapping_parity_fails",  # test_deepseek_v32_bridge.py's (~13 s)
    "test_one_ci_test_grpo_step_with_r3_on_megatron_gives_the_engines_log_probs",  # GPT-OSS: engine + 1 rank
    "test_bridge_layout_step_equals_single_rank",  # GLM-4.5 / GPT-OSS: 2 gloo ranks, ~10 s each
    "test_a_killed_and_a_hung_engine_are_replaced_and_the_run_finishes",
    "test_a_dead_trainer_stops_the_run_with_the_actor_and_the_resume_command",
    "test_the_smoke_preset_trains_from_the_latest_assets",
    "test_a_failed_step_is_retried_and_resumes_without_duplicate_partitions",
    "test_scoreboard_shows_base_and_best_version_per_run", "test_a_cli_launched_runs_versions_appear_as_partitions",
    "test_agentic_ci_test_run_trains_on_session_samples",
    "test_lora_runs_train_concurrently_on_one_engine_and_never_see_each_other",
    "test_a_run_on_s3_checkpoints_publishes_resumes_from_the_store_and_is_queryable",
    "test_assets_show_data_and_the_base_with_sample_images", "test_job_reports_versions_shards_and_evals_like_an_llm_run",
    "test_sensors_leave_diffusion_versions_to_the_loop", "test_rollouts_are_images_duckdb_queries_and_lineage_traces",
    "test_flow_grpo_lifts_the_held_out_reward", "test_cli_resumes_the_run_from_its_checkpoint",
    "test_kill_9_at_every_hook_then_relaunch_loses_and_duplicates_nothing",
    "test_a_multi_turn_generate_function_trains_with_r3_in_a_ci_test_run",
    "test_agentic_sessions_record_the_routes_of_the_whole_session",
    "test_layout_step_equals_single_rank", "test_vocab_parallel_scores_equal_full_vocabulary",
    "test_export_is_the_tp1_export_byte_for_byte", "test_broadcast_streams_a_tp2_trainers_buckets_to_an_engine",
    "test_bf16_with_fp32_main_params_passes_the_step0_ci_checks", "test_recompute_gives_the_step_without_it",
    "test_expert_layout_step_with_routing_replay_equals_single_rank",
    "test_checkpoint_saved_at_one_layout_resumes_at_another",
    "test_the_gsm8k_recipe_runs_two_rollouts_through_miles_platform_train",
    "test_filter_open_a_sample_and_see_its_tokens_shaded",
    "test_train_sft_loss_on_chat_data_records_versions_and_lowers_the_loss",
    "test_sft_on_chat_data_two_ranks_and_megatron_train_like_one_fsdp_rank",
    # test_megatron_fp16_offload.py: one gloo rank trains 8 tiny megatron actors (~11 CPU-s, session 21)
    "test_fp16_step_is_the_fp32_step_within_fp16_rounding", "test_an_inf_gradient_skips_the_step_and_halves_the_scale",
    "test_the_scale_grows_after_the_window", "test_the_scaler_is_saved_and_restored_with_the_optimizer",
    "test_fp16_exports_fp16_weights", "test_the_offloaded_step_is_the_step_on_the_device",
    "test_offloaded_state_lives_on_the_host_and_parameters_on_the_trainer_device",
    "test_the_offloaded_optimizer_resumes_to_the_same_step",
    "test_weights_loaded_without_the_optimizer_become_its_fp32_masters",
    # over 5 s each in `make test-fast` (2026-12-05, 23rd session): a Dagster training job (the
    # short_run fixture's tests, a failing run), a fully async run with its eval, a conversion CLI
    # subprocess, an external engine's weight check
    "test_policy_versions_carry_the_rollouts_training_metrics_as_floats",
    "test_eval_results_is_the_evaluator_of_record_one_row_per_metric",
    "test_rollout_shards_show_reward_spread_truncation_and_a_preview",
    "test_a_missing_dataset_or_a_broken_reward_fails_once_with_its_reason",
    "test_old_form_generate_runs_the_fully_async_rollout_and_the_eval",
    "test_torch_dist_without_metadata_refused_by_cli",
    "test_weight_check_catches_an_external_engine_that_kept_its_old_weights",
}  # fmt: skip


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The xdist controller: once a worker has collected the learning tests, train their SFT bases
    in the background on the idle cycles (tests/background_bases.py); the tests wait for them."""
    config = node.config
    if getattr(config, "_background_bases", None) is None:
        from background_bases import BACKGROUND_DIR, start_background, wanted

        names = wanted(ids)
        config._background_bases = names and start_background(
            config._tmp_path_factory.getbasetemp() / BACKGROUND_DIR, names
        )


def pytest_unconfigure(config):
    """Stop this process's multiprocessing fork server (the gloo-rank tests' preload,
    loop_helpers.spawn_ranks). It stops when its "alive" pipe closes, but every process forked from
    this one after it started (warm-python forks, Ray's) holds that pipe too, so it outlived pytest,
    orphaned with ~400 MB each run; multiprocessing's own stop waits on that pipe and can hang.
    SIGKILL, and a bounded wait: after a whole `make test` a SIGTERMed server did not end, this
    wait blocked, and pytest-xdist killed each worker after its 10 s exit timeout (~20 s idle at
    the end of every run, 2026-12-05). The server holds nothing to flush."""
    base = getattr(config, "_background_bases", None)  # the controller's background SFT, if still training
    if base and base.poll() is None:
        base.kill()
        base.wait()
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                time.sleep(0.02)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    skip_gpu = pytest.mark.skip(
        reason="needs CUDA: scripts/gpu_checks.py (tests/gpu) or scripts/gpu_smoke.sh on a GPU"
    )
    # MILES_GPU_CHECKS_ON_CPU=1: the checks in tests/gpu run on the CPU instead (scripts/gpu_checks.py
    # sets it, so its report is made anywhere; only `"cuda": true` in it is GPU evidence)
    on_cpu = os.environ.get("MILES_GPU_CHECKS_ON_CPU") == "1"
    gpu_dir = Path(__file__).parent / "gpu"
    for item in items:
        # the marker, not `item.keywords`: that holds the folder name "gpu" for every test in tests/gpu
        if item.get_closest_marker("gpu") and not has_cuda and not (on_cpu and gpu_dir in item.path.parents):
            item.add_marker(skip_gpu)
        if getattr(item, "originalname", item.name) in SLOW:
            item.add_marker(pytest.mark.slow)
    # the files that stop the worker's shared Ray (own_ray) go first, before any test started it: each
    # stop made the next test start it again (~3-5 s of CPU a start on 2 cores)
    own = {it.path for it in items if it.get_closest_marker("own_ray")}
    rel = {it.path: LATE.get(it.path.name, str(it.path.relative_to(config.rootpath))) for it in items}
    items.sort(key=lambda it: (it.path not in own, -LONGEST_FIRST.get(it.path.name, 0), rel[it.path]))


@pytest.fixture(scope="session", autouse=True)
def _one_thread_per_worker():
    """Before any module fixture (an SFT base) runs: 1 torch thread per pytest-xdist worker."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _few_threads():
    import torch

    torch.set_num_threads(1)
    yield


# One local Ray cluster per pytest worker, started by the first run that needs one and kept for
# the next: `train` joins a driver connection that is already up and leaves it up (init_ray), so a
# loop test pays for its actors and engines, not for starting and stopping Ray (~5-12 s each on 2
# cores). 32 logical CPUs: every placement plan of the suite fits. Tests of Ray's own lifecycle
# (joining a cluster, a private start) are marked `own_ray`: they get none and start their own.
SHARED_RAY_CPUS = 32


def _all_extras(real, every):
    def extras(cfg):
        return list(every)

    extras.real = getattr(real, "real", real)  # the run's own choice (test_forkserver checks it)
    return extras


@pytest.fixture(autouse=True)
def _one_ray_per_worker(request, monkeypatch):
    ray = sys.modules.get("ray")
    if request.node.get_closest_marker("own_ray"):
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        yield
        return
    from miles_platform.cluster import forkserver, ray_cluster

    real = ray_cluster.init_ray
    # the worker's one fork server preloads every extra, whichever run starts it: a run starts the
    # server at its own start with only the extras it needs (prestart_fork_server), and later runs in
    # the worker reuse it, so a first fsdp run left every megatron actor after it importing
    # megatron-core itself (~4 CPU-s each), a LoRA actor PEFT (~1.7), a diffusion one diffusers (~1)
    every = list(forkserver.EXTRAS)
    monkeypatch.setattr(ray_cluster, "_fork_extras", _all_extras(ray_cluster._fork_extras, every))

    def init_shared(cfg, namespace=None, **init_kwargs):
        import ray

        if (
            not ray.is_initialized()
            and namespace is None
            and not init_kwargs
            and not ray_cluster.resolve_ray_address(cfg)
        ):
            ray_cluster.start_fork_server(*every)  # one server for every test
            ray_cluster.start_local_ray(SHARED_RAY_CPUS)
        return real(cfg, namespace, **init_kwargs)

    monkeypatch.setattr(ray_cluster, "init_ray", init_shared)
    yield


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """A random tiny Qwen3 checkpoint + our tokenizer, saved as an HF dir (fast: < 2 s)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def _serve(argv_for_port, log_path: Path, what: str, timeout_s: float = 30.0, tries: int = 3):
    """Start a server subprocess on a free loopback port and wait until *it* listens there: `ss`
    names its pid on the port. A port another process took between `free_port()` and the bind (a
    Ray worker of the other pytest worker) makes the server exit; then it is tried on a new port.
    Returns (proc, port, log file); the caller kills the process group and closes the log."""
    import psutil

    log = open(log_path, "w")  # noqa: SIM115
    for _ in range(tries):
        port = free_port()
        proc = subprocess.Popen(argv_for_port(port), stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                ps = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                       for p in ps for c in p.net_connections("tcp")):  # fmt: skip
                    return proc, port, log
            time.sleep(0.1)
        if proc.poll() is None:  # up but not listening in time: give up
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
            break
    log.close()
    raise AssertionError(f"{what} did not start: {log_path.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda not installed")
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).with_name("mooncake_master"))
    if not os.path.exists(binary):
        pytest.skip("mooncake_master binary not found next to the interpreter or on PATH")
    log_path = tmp_path_factory.mktemp("mooncake") / "master.log"
    proc, port, log = _serve(
        lambda port: [binary, f"--rpc_port={port}", f"--metrics_port={free_port()}", "--rpc_address=127.0.0.1"],
        log_path, "mooncake_master", timeout_s=20,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{port}"
    finally:
        from miles_platform.cluster.object_store import close_stores

        close_stores()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """moto's S3 server on a free loopback port, in its own process (in this one it would share the
    GIL with the test's DuckDB and s3fs threads); the AWS env vars are the tests' to set. Used by
    tests/e2e/test_object_store_root.py and test_cluster_ray.py."""
    log_path = tmp_path_factory.mktemp("moto") / "server.log"
    argv = lambda port: [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]  # noqa: E731
    proc, port, log = _serve(argv, log_path, "moto server")
    try:
        yield {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        log.close()


def pytest_collection_finish(session):
    """Once the tests are collected (torch, transformers, Ray, Dagster and every test module
    imported): one full collection, then what is left frozen out of every later one, and young
    collections 14x rarer (memory is not short here). Each full collection walked those millions
    of objects again: on tests/unit/store + rollout (2 workers, 2026-12-07) a worker's collections
    took 4.0-5.2 s of its 90, 2.5-3.3 s with this."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 10)
