"""`miles-platform quickstart` (what `make demo` runs): the whole campaign as Dagster materializations.

    prompt_dataset, eval_dataset   built-in arithmetic task, normalized Parquet
    base_checkpoint                SFT of a tiny Qwen3 from scratch (systematic carry errors)
    rl_training job                GRPO on Ray: rollout_shards[v], policy_versions[v]
    eval_results[v]                greedy pass@1 (and sampled metrics) of selected versions
    scoreboard                     every version against the base (v0, evaluated here once)
    summary                        base vs final, read from the `evals` rows those two wrote

`--task diffusion` and `--task vlm` run their own campaigns (run_diffusion_quickstart,
run_vlm_quickstart: the image counting task, a tiny Qwen3-VL SFT base that counts 4 squares as 3,
GRPO on image prompts, greedy held-out accuracy per count in-process since eval datasets read text
only, docs/vlm.md).

Everything lands in a persistent Dagster instance under <root>/dagster, so `make ui` shows the
history afterwards. It lives in the Dagster layer (`ops/`): the engine never imports Dagster; the
`miles-platform` CLI dispatches `quickstart` here lazily.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from miles_platform.metric_names import metric_name
from miles_platform.recipes import DEMO_DIFFUSION, DEMO_RL, DEMO_VLM, DIFFUSION_ROLLOUTS, VLM_ROLLOUTS  # noqa: F401


def _dagster_home(root: str) -> str:
    home = os.path.join(root, "dagster")
    os.makedirs(home, exist_ok=True)
    yaml_path = os.path.join(home, "dagster.yaml")
    if not os.path.exists(yaml_path):
        Path(yaml_path).write_text("telemetry:\n  enabled: false\n")
    return home


def _campaign(root: str):
    """(absolute root, the code location's Definitions, the demo's Dagster instance): every
    campaign's setup, its DAGSTER_HOME and storage root under `root` (the same assets, jobs and
    resources the UI loads)."""
    root = os.path.abspath(root)
    os.environ["DAGSTER_HOME"] = _dagster_home(root)
    os.environ["MILES_STORAGE_ROOT"] = root
    import dagster as dg

    import definitions

    return root, definitions.defs, dg.DagsterInstance.get()


def _fresh_run_name(root: str, base: str) -> str:
    """`demo`, then `demo-2`, ... : rerunning the demo adds a run next to the earlier ones."""
    from miles_platform.store.paths import StoragePaths

    paths, name, i = StoragePaths(root), base, 1
    while os.path.exists(paths.run_dir(name)) or os.path.exists(paths.rollout_shard_dir(name, 0)):
        i += 1
        name = f"{base}-{i}"
    return name


def _log(msg: str) -> None:
    print(f"[quickstart] {msg}", flush=True)


def run_quickstart(
    root: str,
    num_rollout: int,
    seed: int,
    eval_every: int,
    sft_iters: int | None,
    sft_seed: int | None = None,
) -> dict[str, Any]:
    t0 = time.time()
    root, defs, instance = _campaign(root)
    import dagster as dg

    from assets.evals import run_config_for_version
    from assets.metadata import latest_metadata
    from miles_platform.store.paths import partition_key

    _log("materializing prompt_dataset, eval_dataset")
    _run_job(defs, "build_datasets", instance)
    base_cfg: dict[str, Any] = {"mode": "sft"}
    if sft_seed is not None:  # else the recipe's (default_sft_recipe: the demo's base)
        base_cfg["seed"] = sft_seed
    if sft_iters:
        base_cfg["train_iters"] = sft_iters
    _log("materializing base_checkpoint (SFT)")
    _run_job(
        defs, "build_base_checkpoint", instance, run_config={"ops": {"base_checkpoint": {"config": base_cfg}}}
    )
    # The conversion (two subprocesses, mostly megatron's import) runs beside the GRPO run: the
    # rollout/train alternation keeps about one of two cores busy, and the RL run (fsdp) does not
    # read the torch_dist checkpoint. Its own process: one Dagster materialization per process at
    # a time (two threads of one process deadlock). It must succeed all the same: joined below.
    _log("materializing converted_checkpoint (HF -> megatron torch_dist, round-trip check), beside training")
    conversion = subprocess.Popen(
        [sys.executable, "-m", "ops.quickstart", "--storage-root", root, "--run-job", "convert_checkpoint"]
    )  # fmt: skip
    base_md = latest_metadata(instance, "base_checkpoint")
    base_path = str(base_md["path"])
    eval_path = str(latest_metadata(instance, "eval_dataset")["path"])

    _log(f"running rl_training: {num_rollout} rollouts of GRPO")
    run = _fresh_run_name(root, DEMO_RL["run_name"])
    # the storage root is the `storage` resource's (MILES_STORAGE_ROOT above), not run config
    rl = dict(DEMO_RL, run_name=run, seed=seed, num_rollout=num_rollout, rollout_seed=seed)
    from miles_platform.training.sft import default_sft_recipe

    if sft_iters and sft_iters < default_sft_recipe().train_iters:
        # a shortened base is far less sure of itself than the --ci-test entropy bound (0.7 nats)
        # assumes of a trained model: bound it by a uniform distribution's entropy instead
        with open(os.path.join(base_path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        rl["ci_entropy_max"] = round(math.log(vocab), 3)
        _log(
            f"--sft-iters {sft_iters}: the step-0 entropy check is bounded by ln(vocab) = {rl['ci_entropy_max']}"
        )
    job = defs.get_job_def("rl_training")
    try:
        res = job.execute_in_process(
            run_config={"ops": {"rl_training_op": {"config": rl}}}, instance=instance
        )
    except BaseException:
        conversion.wait()  # the training error is the one to report
        raise
    if conversion.wait() != 0:  # a failed conversion fails the demo too
        from miles_platform.errors import MilesError

        raise MilesError(
            f"materializing converted_checkpoint failed (exit {conversion.returncode}; its log is above)"
        )
    out = res.output_for_node("rl_training_op")
    final_key = partition_key(out["run"], out["final_version"])

    keys = sorted(instance.get_dynamic_partitions("policy_versions"))
    keys = [k for k in keys if k.startswith(out["run"] + ".v")]
    chosen = [k for i, k in enumerate(keys, 1) if i % eval_every == 0] + [final_key]  # as the sensor would
    for key in dict.fromkeys(chosen):  # with the run's eval settings, as the sensor launches them
        _log(f"materializing eval_results[{key}]")
        cfg = run_config_for_version(instance, key)
        _run_job(defs, "evaluate_policy", instance, partition_key=key, run_config=cfg or None)
    _log("materializing scoreboard (evaluates the base checkpoint, v0, with the run's eval settings)")
    _run_job(defs, "update_scoreboard", instance)

    _log(f"materializing weight_publications[{final_key}] and quantized_weights[{final_key}, fp8|int4]")
    _run_job(defs, "publish_weights", instance, partition_key=final_key)
    quantized: dict[str, dict[str, float]] = {}
    for fmt in ("fp8", "int4"):
        mk = dg.MultiPartitionKey({"policy_version": final_key, "format": fmt})
        _run_job(defs, "quantize_weights", instance, partition_key=mk)
        md = latest_metadata(instance, "quantized_weights", mk)
        quantized[fmt] = {  # `<dataset>/<metric>`, as eval_results keys them
            k.removeprefix("eval/"): float(v) for k, v in md.items() if k.startswith("eval/")
        }

    from miles_platform.store.catalog import Catalog
    from miles_platform.store.paths import StoragePaths

    paths = StoragePaths(root)
    cat = Catalog(paths)
    _, rows = cat.query(f"select count(*) from rollouts where run = '{out['run']}'")
    curve_cols, curve = cat.query(
        f"select rollout_id, value from metrics where run = '{run}' and name = 'rollout/raw_reward' order by rollout_id"
    )
    summary = {
        **eval_summary(paths, out["run"], out["final_version"]),
        "num_policy_versions": len(keys),
        "num_rollout_rows": int(rows[0][0]),
        "wall_seconds": time.time() - t0,
        "base_checkpoint": base_path,
        "final_checkpoint": str(out["final_hf_path"]),
        "final_policy_version": final_key,
        "eval_dataset": eval_path,
        "quantized_eval": quantized,  # greedy pass@1 of the final version's fp8 / int4 weights vs its own
        "raw_reward_curve": [[int(r), float(v)] for r, v in curve],
        "storage_root": root,
    }
    Path(root, "quickstart_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def eval_summary(paths, run: str, final_version: int, dataset: str = "eval") -> dict[str, Any]:
    """The summary's eval numbers, read from the `evals` rows that eval_results (and, for the base
    v0, the scoreboard) wrote: one source with the asset pages, named as there. The newest row of
    each (version, metric) on `dataset`; the accuracies are greedy pass@1 (None: not evaluated)."""
    from miles_platform.store.paths import partition_key
    from miles_platform.store.tables import read_rows

    newest: dict[int, dict[str, tuple]] = {}
    for r in read_rows(paths, "evals", run):
        if r["dataset"] == dataset:
            name = metric_name(r["metric"], r["n_samples"], r["temperature"])
            seen = newest.setdefault(r["version"], {}).get(name)
            if seen is None or r["created_at"] >= seen[0]:
                newest[r["version"]][name] = (r["created_at"], r["value"])
    values = {v: {m: value for m, (_, value) in ms.items()} for v, ms in sorted(newest.items())}
    base, final = values.get(0, {}), values.get(final_version, {})
    return {
        "base_eval_accuracy": base.get("pass@1"),
        "final_eval_accuracy": final.get("pass@1"),
        "base_eval": base,
        "final_eval": final,
        "eval_per_version": {
            partition_key(run, v): m["pass@1"] for v, m in values.items() if v and "pass@1" in m
        },
    }


def run_diffusion_quickstart(
    root: str, num_rollout: int, seed: int, loss_type: str = "policy_loss"
) -> dict[str, Any]:
    """The diffusion campaign: task datasets -> tiny DiT SFT base -> Flow-GRPO (or NFT) -> evals."""
    t0 = time.time()
    root, defs, instance = _campaign(root)
    _log("materializing diffusion_prompt_dataset, diffusion_eval_dataset, diffusion_sft_dataset")
    _run_job(defs, "build_diffusion_data", instance)
    _log("materializing diffusion_base_checkpoint (flow-matching SFT of the tiny DiT)")
    _run_job(defs, "build_diffusion_base", instance,
             run_config={"ops": {"diffusion_base_checkpoint": {"config": {"seed": seed}}}})  # fmt: skip
    run = _fresh_run_name(root, DEMO_DIFFUSION["run_name"])
    cfg = dict(
        DEMO_DIFFUSION,
        run_name=run,
        num_rollout=num_rollout,
        rollout_seed=seed,
        seed=seed,
        loss_type=loss_type,
    )
    if loss_type == "nft":
        cfg.update(
            use_ema=True, rollout_weights="ema", diffusion_step_strategy_path=None, diffusion_num_sde_steps=0
        )
    _log(
        f"running diffusion_training: {num_rollout} rollouts of {'Flow-GRPO' if loss_type == 'policy_loss' else 'NFT'}"
    )
    res = defs.get_job_def("diffusion_training").execute_in_process(
        run_config={"ops": {"diffusion_training_op": {"config": cfg}}}, instance=instance
    )
    out = res.output_for_node("diffusion_training_op")
    from miles_platform.store.catalog import Catalog
    from miles_platform.store.paths import StoragePaths

    paths = StoragePaths(root)
    cat = Catalog(paths)
    _, evals = cat.query(f"select version, value from evals where run = '{run}' order by version")
    _, rows = cat.query(f"select count(*) from rollouts where run = '{run}'")
    grids = os.path.join(paths.run_dir(run), "evals")
    summary = {
        "task": "diffusion", "loss_type": loss_type, "run": run,
        "base_eval_reward": float(evals[0][1]), "final_eval_reward": float(evals[-1][1]),
        "eval_curve": [[int(v), float(r)] for v, r in evals], "num_policy_versions": int(out["final_version"]),
        "num_rollout_rows": int(rows[0][0]), "final_checkpoint": out["final_hf_path"],
        "final_policy_version": f"{run}.v{out['final_version']:06d}",
        "base_samples": os.path.join(grids, "v000000", "heldout.png"),
        "final_samples": os.path.join(grids, f"v{out['final_version']:06d}", "heldout.png"),
        "wall_seconds": time.time() - t0, "storage_root": root,
    }  # fmt: skip
    Path(root, "quickstart_diffusion_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def print_diffusion_summary(s: dict[str, Any]) -> None:
    print("\n=== miles-platform quickstart --task diffusion ===")
    print(f"base   held-out reward (ODE, fixed seeds): {s['base_eval_reward']:.3f}")
    print(f"final  held-out reward (ODE, fixed seeds): {s['final_eval_reward']:.3f}")
    print(f"policy versions: {s['num_policy_versions']}   rollout rows: {s['num_rollout_rows']}")
    print(f"samples: base {s['base_samples']}\n         final {s['final_samples']}")
    print(
        f"wall time: {s['wall_seconds']:.0f} s   summary: {s['storage_root']}/quickstart_diffusion_summary.json"
    )
    print("\nquery the image rollouts:")
    print(f"  miles-platform query --storage-root {s['storage_root']} \\")
    print(
        f"    \"select rollout_id, avg(reward) from rollouts where run = '{s['run']}' group by 1 order by 1\""
    )
    print(
        f"trace lineage:  miles-platform lineage --storage-root {s['storage_root']} {s['final_policy_version']}"
    )


def run_vlm_quickstart(root: str, num_rollout: int, seed: int) -> dict[str, Any]:
    """Task datasets -> SFT base -> GRPO (rl_training with images) -> greedy held-out evals."""
    t0 = time.time()
    root, defs, instance = _campaign(root)
    from assets.metadata import latest_metadata
    from miles_platform.store.catalog import Catalog
    from miles_platform.store.paths import StoragePaths, partition_key
    from miles_platform.training.vlm_base import greedy_count_accuracy

    _log("materializing vlm_prompt_dataset, vlm_eval_dataset (the image counting task)")
    _run_job(defs, "build_vlm_data", instance)
    _log("materializing vlm_base_checkpoint (SFT of a tiny Qwen3-VL, 4 squares mostly labelled 3)")
    _run_job(defs, "build_vlm_base", instance,
             run_config={"ops": {"vlm_base_checkpoint": {"config": {"seed": 0}}}})  # fmt: skip
    base = str(latest_metadata(instance, "vlm_base_checkpoint")["path"])
    train_path = str(latest_metadata(instance, "vlm_prompt_dataset")["path"])
    eval_path = str(latest_metadata(instance, "vlm_eval_dataset")["path"])

    run = _fresh_run_name(root, DEMO_VLM["run_name"])
    rl = dict(DEMO_VLM, run_name=run, seed=seed, rollout_seed=seed, num_rollout=num_rollout,
              hf_checkpoint=base, prompt_data=train_path, save_interval=None)  # fmt: skip
    _log(f"running rl_training: {num_rollout} rollouts of GRPO on image prompts")
    res = defs.get_job_def("rl_training").execute_in_process(
        run_config={"ops": {"rl_training_op": {"config": rl}}}, instance=instance
    )
    out = res.output_for_node("rl_training_op")
    _log("greedy held-out accuracy of the base and the final policy")
    before = greedy_count_accuracy(base, eval_path)
    after = greedy_count_accuracy(str(out["final_hf_path"]), eval_path)

    cat = Catalog(StoragePaths(root))
    _, rows = cat.query(f"select count(*) from rollouts where run = '{run}'")
    _, curve = cat.query(
        f"select rollout_id, value from metrics where run = '{run}' and name = 'rollout/raw_reward' order by rollout_id"
    )
    summary = {
        "task": "vlm", "run": run, "base_eval": before, "final_eval": after,
        "num_policy_versions": int(out["final_version"]), "num_rollout_rows": int(rows[0][0]),
        "raw_reward_curve": [[int(r), float(v)] for r, v in curve],
        "base_checkpoint": base, "final_checkpoint": str(out["final_hf_path"]),
        "final_policy_version": partition_key(run, out["final_version"]), "eval_dataset": eval_path,
        "wall_seconds": time.time() - t0, "storage_root": root,
    }  # fmt: skip
    Path(root, "quickstart_vlm_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def print_vlm_summary(s: dict[str, Any]) -> None:
    print("\n=== miles-platform quickstart --task vlm ===")
    for when in ("base", "final"):
        e = s[f"{when}_eval"]
        per = "  ".join(f"{k}: {v:.0%}" for k, v in e["per_count"].items())
        print(f"{when:<6} held-out greedy accuracy {e['acc']:.1%}   per count  {per}")
    print(f"policy versions: {s['num_policy_versions']}   rollout rows: {s['num_rollout_rows']}")
    print(f"final policy: {s['final_policy_version']} -> {s['final_checkpoint']}")
    print(f"wall time: {s['wall_seconds']:.0f} s   summary: {s['storage_root']}/quickstart_vlm_summary.json")
    print("\nwhich image each sample saw:")
    print(f"  miles-platform query --storage-root {s['storage_root']} \\")
    print(
        f"    \"select image_hashes[1] as image, avg(reward) from rollouts where run = '{s['run']}' group by 1 limit 10\""
    )
    print("see it in the UI: make ui  (http://127.0.0.1:3000, asset group vlm)")


def _run_job(defs, name: str, instance, partition_key=None, run_config=None):
    """One of the code location's named jobs (ops/asset_jobs.py, the sensors' jobs): the run shows
    under that name in the UI and can be re-executed there."""
    result = defs.resolve_job_def(name).execute_in_process(
        instance=instance, partition_key=partition_key, run_config=run_config
    )
    if not result.success:
        raise RuntimeError(f"job {name} failed")
    return result


def _pct(value: float | None) -> str:
    return "not evaluated" if value is None else f"{value:.1%}"


def print_summary(s: dict[str, Any]) -> None:
    print("\n=== miles-platform quickstart ===")
    for when in ("base", "final"):  # the evals rows of eval_results / the scoreboard, named as there
        got = s[f"{when}_eval"]
        sampled = "".join(f", {m} {v:.1%}" for m, v in got.items() if "(T=" in m and m.startswith("pass@"))
        print(f"{when:<6} eval accuracy: pass@1 (greedy) {_pct(got.get('pass@1'))}{sampled}")
    for fmt, q in s.get("quantized_eval", {}).items():
        if "pass@1" in q:
            print(f"final  {fmt:<5} weights (quantized_weights): {q['pass@1']:.1%} "
                  f"(full precision {q['pass@1_full_precision']:.1%}, same eval prompts)")  # fmt: skip
    print(f"policy versions: {s['num_policy_versions']}   rollout rows: {s['num_rollout_rows']}")
    print(f"final policy: {s['final_policy_version']} -> {s['final_checkpoint']}")
    print(f"wall time: {s['wall_seconds']:.0f} s   summary: {s['storage_root']}/quickstart_summary.json")
    print("\nquery the rollouts:")
    print(f"  miles-platform query --storage-root {s['storage_root']} \\")
    print(
        '    "select rollout_id, avg(reward) as reward, avg(response_length) as len from rollouts group by 1 order by 1"'
    )
    print(
        f"trace lineage:  miles-platform lineage --storage-root {s['storage_root']} {s['final_policy_version']}"
    )
    print("see it in the UI: make ui  (http://127.0.0.1:3000)")


def _run_one_job(root: str, name: str) -> int:
    """One named job into the demo's instance (run beside training by run_quickstart)."""
    _, defs, instance = _campaign(root)
    _run_job(defs, name, instance)
    return 0


def cli_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform quickstart", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--storage-root", default=".miles")
    ap.add_argument("--num-rollout", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--eval-every", type=int, default=10, help="evaluate every N-th policy version (and the last)"
    )
    ap.add_argument("--sft-iters", type=int, default=None, help="override the SFT recipe's train iterations")
    ap.add_argument(
        "--sft-seed",
        type=int,
        default=None,
        help="override the SFT recipe's seed (default: default_sft_recipe's)",
    )
    ap.add_argument("--run-job", metavar="JOB", help=argparse.SUPPRESS)  # one named job (the demo's helper)
    ap.add_argument("--task", choices=("llm", "diffusion", "vlm"), default="llm",
                    help="llm: arithmetic GRPO (the default demo); diffusion: Flow-GRPO on a tiny DiT; "
                         "vlm: GRPO of a tiny Qwen3-VL on an image counting task")  # fmt: skip
    ap.add_argument("--loss-type", choices=("policy_loss", "nft"), default="policy_loss",
                    help="--task diffusion: Flow-GRPO (policy_loss) or DiffusionNFT (nft)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.run_job:
        return _run_one_job(args.storage_root, args.run_job)
    if args.task == "vlm":
        n = args.num_rollout if "--num-rollout" in argv else VLM_ROLLOUTS
        print_vlm_summary(run_vlm_quickstart(args.storage_root, n, args.seed))
        return 0
    if args.task == "diffusion":
        n = args.num_rollout if "--num-rollout" in argv else DIFFUSION_ROLLOUTS
        print_diffusion_summary(run_diffusion_quickstart(args.storage_root, n, args.seed, args.loss_type))
        return 0
    summary = run_quickstart(
        args.storage_root, args.num_rollout, args.seed, args.eval_every, args.sft_iters, args.sft_seed
    )
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
