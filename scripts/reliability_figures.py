"""The reliability figures of docs/RELIABILITY.md, tallied from the tests that try each case.

    .venv/bin/python scripts/reliability_figures.py                  # count, print the table
    .venv/bin/python scripts/reliability_figures.py --run infra      # run one category's tests
    .venv/bin/python scripts/reliability_figures.py --write          # put the table into the doc

Every tried case is a test in the suite: `TRIES` maps each category to its tests (pytest node ids,
so every parametrization counts) and, where a test loops over cases of its own, to that list (a
module-level list counted by importing the module, or a list / dict literal inside the test counted
from its source). Counting collects the suite (`pytest --collect-only -q`) and runs nothing.

`--run CATEGORY` runs that category's tests once (one category at a time: the machine is shared)
and records, per category, how many cases passed, the seconds and the date in
docs/reliability_figures.json; a case passes when its test does, and every test asserts the outcome
the category counts (survived, isolated, a clear error). `--write` puts the table, from the counts
and the recorded runs, at the top of docs/RELIABILITY.md. "Data lost or corrupted" counts the
cases whose test checks every row, version and weight after the fault (`data=True`) and failed.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "RELIABILITY.md"
RESULTS = ROOT / "docs" / "reliability_figures.json"
BEGIN, END = "<!-- reliability-figures:begin -->", "<!-- reliability-figures:end -->"


@dataclass(frozen=True)
class Try:
    """Test `node` (a node id; every parametrization of it counts) tries `per_node` cases each:
    1, or the length of `cases`: "module:ATTR" (imported) or "=name" (a list / dict literal of that
    name inside the test function), or `n` where the test tries cases one after the other in its
    body with no list (say which in a comment). `data`: the test checks that nothing was lost or
    corrupted."""

    node: str
    cases: str | None = None
    data: bool = False
    n: int | None = None


CATEGORIES = {
    "infra": "Infrastructure faults survived (kill -9, hangs, dead peers, resets, crashes mid-write)",
    "samples": "Bad samples from user code isolated (NaN / inf, out-of-vocabulary, hung or crashing functions)",
    "cli": "Bad inputs with a clear error: CLI flags, configs and input files",
    "http": "Bad inputs with a clear error: engine, router and session HTTP",
    "delta": "Bad inputs with a clear error: disk-delta corruptions and publications",
    "dagster": "Bad inputs with a clear error: Dagster configs and assets",
}

E2E, UNIT, DAG = "tests/e2e/", "tests/unit/", "tests/dagster/"
TRIES: dict[str, list[Try]] = {
    "infra": [
        Try(E2E + "test_crash_matrix.py::test_kill_9_at_every_hook_then_relaunch_loses_and_duplicates_nothing",
            "tests.e2e.test_crash_matrix:MATRIX", data=True),
        Try(E2E + "test_trainer_fault_hooks.py::test_kill_9_of_a_trainer_rank_at_a_rank_hook_stops_the_run_and_the_relaunch_resumes", data=True),
        Try(E2E + "test_diffusion_crash.py::test_kill_9_of_train_diffusion_then_relaunch_abandons_past_the_checkpoint_and_reuses_no_version",
            "tests.e2e.test_diffusion_crash:KILLS", data=True),
        Try(E2E + "test_fault_tolerance.py::test_a_killed_and_a_hung_engine_are_replaced_and_the_run_finishes",
            "tests.e2e.test_fault_tolerance:FAULTS", data=True),
        Try(E2E + "test_fault_tolerance.py::test_a_dead_trainer_stops_the_run_with_the_actor_and_the_resume_command"),
        Try(E2E + "test_fault_tolerance.py::test_stopping_the_engines_waits_for_them_together_and_a_hung_one_does_not_hold_it"),
        Try(E2E + "test_loop.py::test_resume_after_a_crash_never_reuses_a_version_key", data=True),
        Try(E2E + "test_loop.py::test_disk_delta_run_resumes_past_versions_published_after_its_checkpoint", data=True),
        Try(E2E + "test_loop.py::test_version_numbers_continue_past_every_store_that_knows_one", data=True),
        Try(E2E + "test_loop.py::test_one_writer_per_run_and_a_dead_writers_lock_is_taken_over", data=True),
        Try(UNIT + "store/test_compaction.py::test_a_crash_at_any_step_shows_each_row_once_and_a_rerun_repairs", data=True),
        Try(UNIT + "store/test_compaction.py::test_a_query_whose_file_vanished_under_it_is_asked_again"),
        Try(UNIT + "store/test_run_events.py::test_a_resume_abandons_what_the_crashed_attempt_made_after_its_checkpoint", data=True),
        Try(UNIT + "store/test_save_dir_owner.py::test_a_save_dir_of_another_run_is_refused_before_it_is_touched", data=True),
        Try(UNIT + "store/test_save_dir_owner.py::test_one_writer_per_save_dir", data=True),
        Try(UNIT + "store/test_writer_lease.py::test_a_second_writer_with_another_cache_dir_is_refused_until_the_first_releases", data=True),
        Try(UNIT + "store/test_writer_lease.py::test_a_killed_or_expired_holders_lease_is_taken_over_and_a_replaced_one_is_noticed", data=True),
        Try(UNIT + "weights/test_disk_delta.py::test_crash_before_rename_publishes_nothing", data=True),
        Try(UNIT + "weights/test_disk_delta.py::test_crash_between_rename_and_latest", data=True),
        Try(UNIT + "weights/test_disk_delta.py::test_racing_publishers_one_wins_cleanly", data=True),
        Try(UNIT + "weights/test_disk_delta.py::test_lock_held_by_live_process_blocks_dead_one_is_broken", data=True),
        Try(UNIT + "rollout/test_control_calls.py::test_a_control_call_on_a_reset_connection_is_sent_again"),
        Try(UNIT + "rollout/test_control_calls.py::test_an_engine_that_stopped_answering_stops_the_run_in_one_line"),
        Try(UNIT + "cluster/test_trainer_calls.py::test_a_rank_that_does_not_answer_stops_the_run_by_name"),
        Try(UNIT + "rollout/test_router.py::test_router_spreads_load_broadcasts_and_survives_a_dead_engine"),
        Try(UNIT + "rollout/test_router.py::test_a_worker_that_takes_a_request_and_hangs_gets_504_and_leaves_rotation"),
        Try(UNIT + "rollout/test_engine_control.py::test_a_request_waiting_on_a_paused_engine_gets_503_after_the_limit"),
        Try(UNIT + "rollout/test_engine_control.py::test_waiters_beyond_the_bound_get_503_at_once_and_continue_releases_the_rest"),
        Try(UNIT + "rollout/test_engine_control.py::test_the_router_passes_a_paused_engines_503_through_and_keeps_the_worker"),
        Try(UNIT + "rollout/test_engine_control.py::test_weight_group_joins_to_a_dead_port_are_bounded_and_do_not_pile_up"),
    ],
    "samples": [
        Try(UNIT + "training/test_nonfinite.py::test_the_rollout_removes_a_sample_with_a_nonfinite_reward_or_log_prob", "=rows"),
        Try(UNIT + "training/test_nonfinite.py::test_a_nan_reward_leaves_the_rest_of_its_group_normalized_over_the_finite_ones"),
        Try(UNIT + "training/test_nonfinite.py::test_a_nonfinite_loss_skips_the_step_and_keeps_the_weights"),
        Try(UNIT + "training/test_nonfinite.py::test_the_run_stops_by_name_past_max_nonfinite_steps"),
        Try(UNIT + "training/test_nonfinite.py::test_an_out_of_vocabulary_token_fails_its_sample_only"),
        Try(UNIT + "training/test_miles_exact.py::test_loss_and_gradient_are_finite_for_any_log_ratio_and_any_masked_value"),
        Try(UNIT + "training/test_miles_exact.py::test_a_minus_inf_log_prob_at_a_masked_token_leaves_the_loss_finite"),
        Try(UNIT + "rollout/test_generate_hub.py::test_a_hung_generate_function_fails_its_own_samples_after_the_timeout"),
        Try(UNIT + "rollout/test_generate_hub.py::test_a_tool_that_raises_or_times_out_fails_the_episode"),
        Try(UNIT + "rollout/test_generate_hub.py::test_a_trajectory_past_the_response_budget_is_truncated"),
        # an agent that exits 3, one that hangs, one that returns a list, one that raises
        Try(UNIT + "rollout/test_tito.py::test_a_crashing_a_hung_and_a_raising_agent_fail_only_their_own_sample", n=4),
        Try(UNIT + "rollout/test_tito.py::test_a_template_that_rewrites_earlier_turns_fails_the_sample"),
    ],
    "cli": [
        Try(UNIT + "config/test_config_ranges.py::test_out_of_range_flags_are_refused_naming_the_flag"),
        Try(UNIT + "config/test_config_ranges.py::test_run_names_that_are_not_names_are_refused"),
        Try(UNIT + "config/test_config_ranges.py::test_seeds_every_rng_takes"),
        Try(UNIT + "config/test_config_ranges.py::test_yaml_errors_name_the_file_and_key"),
        Try(UNIT + "config/test_config_ranges.py::test_choices_hold_outside_argparse_too"),
        Try(UNIT + "config/test_config_ranges.py::test_a_null_for_a_flag_with_choices_and_a_default_is_refused_by_name"),
        Try(UNIT + "config/test_preflight_paths.py::test_a_root_the_run_cannot_write_is_refused_before_start"),
        Try(UNIT + "config/test_preflight_paths.py::test_a_directory_as_prompt_data_is_named"),
        Try(UNIT + "config/test_preflight_paths.py::test_a_tokenizer_larger_than_the_embedding_is_refused"),
        Try(UNIT + "config/test_preflight_paths.py::test_a_batch_larger_than_the_dataset_is_refused_before_start"),
        Try(UNIT + "store/test_run_events.py::test_bad_fault_hooks_are_refused_by_validate"),
        Try(UNIT + "rollout/test_generate_hub.py::test_a_bad_generate_setup_is_a_config_error_before_ray_starts"),
        Try(UNIT + "rollout/test_engine_control.py::test_pause_limits_are_validated_before_the_engine_loads"),
        Try(UNIT + "rollout/test_tito.py::test_agentic_flags_are_validated_before_start"),
        Try(UNIT + "training/test_miles_exact.py::test_correction_flags_without_effect_are_refused_by_name"),
        Try(UNIT + "training/test_nonfinite.py::test_a_base_checkpoint_with_nan_weights_is_refused_naming_the_tensor"),
        Try(UNIT + "models/test_models_checkpoint.py::test_truncated_or_foreign_weights_are_named"),
        Try(UNIT + "models/test_models_checkpoint.py::test_tokenizer_that_does_not_load_is_named"),
        Try(UNIT + "diffusion/test_diffusion_engine.py::test_contradictory_flags_are_refused_at_parse_time"),
        Try(UNIT + "cluster/test_ray_token.py::test_a_world_readable_token_is_tightened_and_kept"),
        Try(UNIT + "rollout/test_fuzz.py::test_prompt_dataset_loader_accepts_or_names_the_problem"),
        Try(E2E + "test_fault_tolerance.py::test_fault_tolerance_refuses_what_it_cannot_restart"),
        Try(E2E + "test_loop.py::test_bad_config_fails_before_any_engine_starts"),
        Try(E2E + "test_loop.py::test_a_bad_post_write_hook_fails_before_anything_starts"),
        Try(E2E + "test_loop.py::test_flags_not_built_are_refused_not_ignored"),
        Try(E2E + "test_loop.py::test_a_resume_that_would_train_something_else_is_refused"),
        Try(E2E + "test_diffusion_crash.py::test_a_hook_the_diffusion_loop_never_fires_is_refused_naming_those_it_does"),
    ],
    "http": [
        Try(UNIT + "rollout/test_fuzz.py::test_the_http_api_answers_bad_requests_with_a_4xx_never_a_500"),
        Try(UNIT + "rollout/test_fuzz.py::test_the_control_routes_answer_bad_requests_with_a_4xx_and_the_engine_recovers"),
        Try(UNIT + "rollout/test_fuzz.py::test_generate_body_parser_accepts_or_gives_a_400_message"),
        Try(UNIT + "rollout/test_engine.py::test_bad_input_is_400_and_engine_keeps_serving"),
        Try(UNIT + "rollout/test_engine.py::test_every_route_but_health_needs_the_run_key"),
        Try(UNIT + "rollout/test_engine.py::test_api_key_and_request_size_limit"),
        Try(UNIT + "rollout/test_engine_control.py::test_bad_pause_mode_is_400"),
        Try(UNIT + "rollout/test_engine_control.py::test_disk_updates_only_from_allowed_roots_and_only_forward"),
        Try(UNIT + "rollout/test_engine_control.py::test_a_huge_prompt_is_refused_before_tokenizing"),
        Try(UNIT + "rollout/test_engine_control.py::test_update_weights_from_tensors_roundtrip_and_validation"),
        Try(UNIT + "rollout/test_lora_engine.py::test_malformed_and_non_finite_adapters_are_400s_and_load_nothing", "=cases"),
        Try(UNIT + "rollout/test_lora_engine.py::test_an_adapter_belongs_to_the_key_that_loaded_it"),
        Try(UNIT + "rollout/test_tito.py::test_big_chats_long_sessions_and_session_floods_get_clear_errors"),
        Try(UNIT + "rollout/test_tito.py::test_an_agent_gets_a_generate_only_key_and_cannot_swap_weights_or_pause"),
        Try(UNIT + "rollout/test_router.py::test_router_errors_auth_and_no_workers"),
        Try(UNIT + "diffusion/test_diffusion_engine.py::test_engine_endpoints_need_the_secret_and_refuse_bad_requests"),
    ],
    "delta": [
        Try(UNIT + "weights/test_disk_delta.py::test_corrupt_publication_fails_closed"),
        Try(UNIT + "weights/test_disk_delta.py::test_flipped_byte_names_the_tensor"),
        Try(UNIT + "weights/test_disk_delta.py::test_xor_applied_twice_or_to_wrong_base_is_refused"),
        Try(UNIT + "weights/test_disk_delta.py::test_sparse_update_applies_by_scatter_and_fails_closed"),
        Try(UNIT + "weights/test_disk_delta.py::test_lowbits_default_applies_in_place_and_undoes_on_failure"),
        Try(UNIT + "weights/test_disk_delta.py::test_unknown_filter_is_refused"),
        Try(UNIT + "weights/test_disk_delta.py::test_layout_mismatch_is_refused"),
        Try(UNIT + "weights/test_weights_cli.py::test_apply_failure_is_one_line_and_leaves_checkpoint"),
        Try(UNIT + "weights/test_weights_cli.py::test_a_nan_or_reshaped_target_and_a_fifo_in_a_publication_are_refused_cleanly", "=cases"),
        Try(UNIT + "rollout/test_fuzz.py::test_publication_pointer_and_index_parsers_refuse_garbage"),
        Try(UNIT + "rollout/test_fuzz.py::test_safetensors_check_refuses_garbage"),
    ],
    "dagster": [
        Try(DAG + "test_ops_training.py::test_config_without_a_reward_fails_fast_naming_the_key"),
        Try(DAG + "test_ops_training.py::test_function_flags_the_function_does_not_take_fail_fast"),
        Try(DAG + "test_ops_training.py::test_a_config_error_from_the_launchpad_names_the_yaml_key"),
        Try(DAG + "test_ops_training.py::test_a_missing_dataset_or_a_broken_reward_fails_once_with_its_reason"),
        Try(DAG + "test_ops_training.py::test_an_api_key_typed_in_the_launchpad_is_refused_and_never_stored_in_a_row"),
        Try(DAG + "test_assets_datasets.py::test_bad_data_materializes_nothing"),
        Try(DAG + "test_assets_datasets.py::test_blocking_checks_catch_a_bad_file"),
        Try(DAG + "test_assets_datasets.py::test_schema_check_fails_on_foreign_parquet"),
        Try(DAG + "test_evals_asset.py::test_missing_hf_export_fails_with_a_clear_message"),
        Try(DAG + "test_run_health.py::test_a_diffusion_export_missing_a_transformer_tensor_is_red"),
        Try(DAG + "test_sensors_evals.py::test_the_policy_is_set_from_the_environment_and_a_bad_value_names_the_variable"),
        Try(UNIT + "models/test_models_checkpoint.py::test_base_checkpoint_asset_registers_existing_and_refuses_bad_dirs"),
    ],
}  # fmt: skip


def _files() -> list[str]:
    return sorted({t.node.partition("::")[0] for tries in TRIES.values() for t in tries})


def collect(files: list[str]) -> list[str]:
    """Every node id pytest collects in `files` (nothing runs)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT, capture_output=True, text=True, env=_env(),
    )  # fmt: skip
    nodes = [line for line in out.stdout.splitlines() if "::" in line]
    if out.returncode != 0 or not nodes:
        raise SystemExit(
            f"pytest --collect-only failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    return nodes


def _env() -> dict:
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def matching(t: Try, nodes: list[str]) -> list[str]:
    """The collected node ids of `t`: the test itself or its parametrizations."""
    return [n for n in nodes if n == t.node or n.startswith(t.node + "[")]


def per_node(t: Try) -> int:
    if t.cases is None:
        return t.n or 1
    if t.cases.startswith("="):
        return _literal_len(t.node, t.cases[1:])
    module, _, attr = t.cases.partition(":")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    return len(getattr(importlib.import_module(module), attr))


def _literal_len(node: str, name: str) -> int:
    """Length of the list / dict / tuple literal assigned to `name` inside the test function."""
    path, _, func = node.partition("::")
    tree = ast.parse((ROOT / path).read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == func:
            for a in ast.walk(fn):
                if isinstance(a, ast.Assign) and any(
                    isinstance(x, ast.Name) and x.id == name for x in a.targets
                ):
                    v = a.value
                    if isinstance(v, ast.Dict):
                        return len(v.keys)
                    if isinstance(v, ast.List | ast.Tuple):
                        return len(v.elts)
    raise SystemExit(f"{node}: no list or dict literal named {name!r} in the test")


def tally(nodes: list[str]) -> dict[str, dict]:
    """Per category: its node ids with their case counts, the cases tried, and those that check data."""
    out = {}
    for cat, tries in TRIES.items():
        rows = []
        for t in tries:
            found = matching(t, nodes)
            if not found:
                raise SystemExit(f"{cat}: {t.node} is not collected (renamed or removed?): update TRIES")
            k = per_node(t)
            rows += [(n, k, t.data) for n in found]
        out[cat] = {
            "nodes": rows,
            "tried": sum(k for _, k, _ in rows),
            "data_checked": sum(k for _, k, d in rows if d),
        }
    return out


def run(cat: str, counts: dict) -> dict:
    """Run one category's tests once; per node id passed or not (pytest's junit report)."""
    import xml.etree.ElementTree as ET

    junit = Path(tempfile.gettempdir()) / f"reliability-{cat}-{os.getpid()}.xml"
    ids = [n for n, _, _ in counts[cat]["nodes"]]
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *ids],
        cwd=ROOT, env=_env(),
    )  # fmt: skip
    seconds = time.monotonic() - t0
    passed, skipped = set(), set()
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        if case.find("skipped") is not None:
            skipped.add(name)
        elif case.find("failure") is None and case.find("error") is None:
            passed.add(name)
    junit.unlink()
    res = {"date": datetime.date.today().isoformat(), "seconds": round(seconds), "passed": 0, "failed": [],
           "skipped": [], "data_lost": 0}  # fmt: skip
    for n, k, data in counts[cat]["nodes"]:  # a node missing from the report counts as failed
        if n in passed:
            res["passed"] += k
        elif n in skipped:
            res["skipped"].append(n)
        else:
            res["failed"].append(n)
            res["data_lost"] += k if data else 0
    return res


def table(counts: dict, results: dict) -> str:
    lines = [
        "| Category | Outcome / tried | Tests | Last run |",
        "| - | - | - | - |",
    ]
    lost, checked = 0, 0
    for cat, what in CATEGORIES.items():
        c, r = counts[cat], results.get(cat)
        ok = f"**{r['passed']} / {c['tried']}**" if r else f"not run / {c['tried']}"
        run_at = f"{r['date']}, {r['seconds']} s" if r else "-"
        if r and (r["failed"] or r["skipped"]):
            run_at += f"; failed: {len(r['failed'])}, skipped: {len(r['skipped'])}"
        lines.append(f"| {what} | {ok} | {len({n.partition('[')[0] for n, _, _ in c['nodes']})} | {run_at} |")
        checked += c["data_checked"]
        lost += r["data_lost"] if r else 0
    all_run = all(cat in results for cat in CATEGORIES)
    lines.append(
        f"| Cases with data lost or corrupted (of the {checked} whose test checks every row, version "
        f"and weight after the fault) | **{lost if all_run else 'not run'}** | | |"
    )
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    block = (
        f"{BEGIN}\n## The figures\n\nCounted from the tests that try each case and confirmed by running "
        "them, one category at a time; regenerate with `.venv/bin/python scripts/reliability_figures.py "
        "--run <category>` for each of " + ", ".join(f"`{c}`" for c in CATEGORIES) + ", then `--write` "
        "(the script lists every test it counts: `--list`). A case counts as survived, isolated or a clear "
        "error when its test, which asserts that outcome, passes; a failed test among those that check "
        "the data after a fault counts all its cases as data lost. Seconds are one category's tests run "
        "alone on the shared 2-core dev box.\n\n" + text + f"\n{END}\n"
    )
    if BEGIN in doc:
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END) + "\n", lambda _: block, doc, flags=re.S)
    else:
        head, _, rest = doc.partition("\n## ")
        doc = f"{head}\n{block}\n## {rest}"
    DOC.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", choices=sorted(CATEGORIES), action="append", default=[],
                    help="run this category's tests once and record the outcome (repeatable)")  # fmt: skip
    ap.add_argument("--write", action="store_true", help="put the table at the top of docs/RELIABILITY.md")
    ap.add_argument("--list", action="store_true", help="list every node id counted, with its cases")
    args = ap.parse_args(argv)
    counts = tally(collect(_files()))
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for cat in args.run:
        results[cat] = run(cat, counts)
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if args.list:
        for cat, c in counts.items():
            for n, k, data in c["nodes"]:
                print(f"{cat:8} {k:3} {'data' if data else '    '} {n}")
    text = table(counts, results)
    print(text)
    if args.write:
        write_doc(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
