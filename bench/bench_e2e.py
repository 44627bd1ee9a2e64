"""End to end: seconds per GRPO step of `loop.train` vs a bare single-process GRPO loop.

Both start from the same short-SFT base (bench_rollout.sft_base: the quickstart's tiny Qwen3, whose
answers end with EOS) on the same arithmetic prompts, with the quickstart's recipe `DEMO_RL`
(16 prompts x 8 samples, T=1, <= 8 new tokens, lr 1e-4, token-mean loss, one optimizer step per
rollout). The first step of each is warm-up and dropped; the headline rows are medians of the 10
measured steps (on a 2-core VM one step in ten can take 2-4x the others: a median of 10 moved
0.14-0.18 s between two runs of the bare loop where the mean of 5 moved 0.13-0.24). Order: TRL, the
bare loop, then ours, then ours as `train-async` (Miles' one-step overlap), then ours --fully-async
(its default `--rollout-submission-granularity sample`), then --fully-async with `group`, then `train`
without the recipe's `--ci-test` checks (TRL runs none of the kind), in one process, then TRL again
(its row pools both runs' steps: TRL's two threads stall on any load of either core, and one
11-step run read 0.10-0.18 s within an hour, 2026-12-07).

- ours: `miles_platform.loop.train` on Ray (trainer actor, embedded engine, batched requests,
  rollout shards, HF export + weight update every step, --ci-test checks, metrics table).
- baseline: the loop a user would write in one process: batched HF `generate`, the same math
  reward, GRPO advantages, the same clipped policy loss (`loss.policy_loss_function`), AdamW.
  No shards, no export, no engine sync: the bare minimum of work per step. Its grader is loaded
  before the first step (`rm_hub.warm_up_rewards`, as `RolloutManager` does for ours), so neither
  side pays `math_verify`'s first import inside a measured step.
- TRL baseline: TRL's `GRPOTrainer` (bench/trl_grpo.py) on the same base, prompts and recipe, run
  in its own venv (`make bench-trl-env` -> .venv-trl, or $MILES_TRL_PYTHON) as a subprocess.
  Without that venv its row says how to create it; the bench goes on.
- threads: the bare loop and TRL run at torch's default, one thread per core (2 on the project's
  VM): what a user of either gets. Ours runs one thread in each of its processes (the trainer, the
  engine); its second core is the overlap of those processes (until 2026-12-07 both baselines were
  pinned to one thread, half the machine, which flattered ours).

Rows: seconds per step (ratio: ours / bare, goal <= 1.3); ours vs TRL (ratio: ours / TRL, goal
< 1.0); `train-async` (rollout k+1 generates while k trains, each weight update waits for it) vs
sync and vs TRL (goal <= 0.8, #52's); --fully-async (generation of the next rollout overlaps training) vs sync at the same samples per step; --fully-async's `sample` vs `group`
submission granularity (each group is one request either way; `sample` streams it and frees a slot
per finished sample); then each phase of ours as a
share of its step. peak_rss_mb: the driver's peak (Ray actors are other processes).

Whole runs (with the TRL venv), from the demo's SFT base (1200 iterations; ~75 s to build here):
`miles-platform train` as a user starts it (a fresh process: Ray, engine, trainer), then
`miles-platform train-async` (Miles' one-step overlap), vs TRL's script, 100 steps each on seeds
1-3, one after the other: wall from
process start to exit, peak RSS of each process tree (ours: driver + Ray + actors; sampled every
0.2 s), and held-out greedy pass@1 of both final policies by the same evaluator (512 prompts).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import error_row, main, project_env, row

# Tolerance (bench/baseline.py: `make bench` flags a ratio that moved the wrong way by more): ours /
# bare moved 1.02-1.63 over 2026-12-04/05 runs, ours / TRL 1.51-1.69 (2.1 under load)
NOISE = 0.35
CORES = len(os.sched_getaffinity(0))  # torch's default intra-op threads: one per core

ROLLOUTS = 11  # 1 warm-up + 10 measured
TRL_ROW = "e2e: s per GRPO step, loop.train vs TRL GRPOTrainer"
TRL_SCRIPT = Path(__file__).resolve().parent / "trl_grpo.py"
TRL_TIMEOUT_S = 600
# whole runs (start to exit, then a held-out greedy eval of the final policy), with the TRL venv only;
# MILES_BENCH_WHOLE_SEEDS="" skips them (3 seeds x 100 steps x 3 loops: ~5 min here)
WHOLE_SEEDS = tuple(int(x) for x in os.environ.get("MILES_BENCH_WHOLE_SEEDS", "1,2,3").split(",") if x)
WHOLE_STEPS = 100
WHOLE_EVAL_PROMPTS = 512
PHASES = ("perf/rollout_time", "perf/actor_train_time", "perf/update_weights_time",
          # the driver's own: the version's weights (gathered in the train call where the driver
          # feeds the engines), its HF export, its rows (the shard is written beside the train call:
          # perf/rollout_shard_time overlaps it, so it is not one of the step's parts)
          "perf/get_weights_time", "perf/export_hf_time", "perf/record_version_time")  # fmt: skip


def bare_grpo_loop(base: str, prompts_path: str, steps: int) -> list[float]:
    """Seconds of each step of a plain single-process GRPO loop (see the module docstring)."""
    from bench.bench_rollout import hf_generate
    from miles_platform.config import RunConfig
    from miles_platform.data.dataset import load_prompt_dataset
    from miles_platform.data.sample import Sample
    from miles_platform.models.checkpoint import load_hf_checkpoint
    from miles_platform.recipes import DEMO_RL
    from miles_platform.rollout import rm_hub
    from miles_platform.training import loss as loss_hub

    cfg = RunConfig(**dict(DEMO_RL, run_name="bare"), hf_checkpoint=base, prompt_data=prompts_path).validate()
    model, tok = load_hf_checkpoint(base)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    records = load_prompt_dataset(prompts_path, input_key="prompt", label_key="label")
    rm_hub.warm_up_rewards(cfg.rm_type)
    n, b = cfg.n_samples_per_prompt, cfg.rollout_batch_size
    rng = np.random.default_rng(0)
    times, threads = [], torch.get_num_threads()
    torch.set_num_threads(CORES)  # as a user's script runs (module docstring); ours pins its own
    for step in range(steps):
        t0 = time.perf_counter()
        recs = [records[i] for i in rng.choice(len(records), b, replace=False) for _ in range(n)]
        prompts = [tok.encode(r.prompt, add_special_tokens=False) for r in recs]
        model.eval()
        texts = hf_generate(model, tok, prompts, 1.0, step)
        responses = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
        samples = [Sample(index=i, group_index=i // n, response=t, label=r.label)
                   for i, (r, t) in enumerate(zip(recs, texts, strict=True))]  # fmt: skip
        rm_hub.compute_rewards(cfg, samples)
        adv = loss_hub.group_normalize_rewards(torch.tensor([s.raw_reward for s in samples]), n, True)
        model.train()
        seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        logits = model(input_ids=ids).logits.float()
        lps = []
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            lsm = torch.log_softmax(logits[i, len(p) - 1 : len(p) + len(r) - 1], -1)
            lps.append(lsm.gather(-1, torch.tensor(r)[:, None])[:, 0])
        batch = {
            "advantages": [torch.full_like(lp, float(a)) for lp, a in zip(lps, adv, strict=True)],
            "old_log_probs": [lp.detach() for lp in lps],
            "rollout_log_probs": [lp.detach() for lp in lps],
            "ref_log_probs": None,
            "loss_masks": [torch.ones_like(lp) for lp in lps],
            "response_lengths": [len(r) for r in responses],
        }
        loss, _ = loss_hub.policy_loss_function(cfg, batch, lps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return times


def trl_python() -> str | None:
    """The TRL venv's interpreter: $MILES_TRL_PYTHON, else the repo's .venv-trl; None if neither exists."""
    env = os.environ.get("MILES_TRL_PYTHON")
    path = Path(env) if env else TRL_SCRIPT.parents[1] / ".venv-trl" / "bin" / "python"
    return str(path) if path.exists() else None


def trl_env() -> dict[str, str]:
    """bench/trl_grpo.py's environment: the TRL venv's own packages only, never this repo's; torch's
    default threads, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    env.pop("OMP_NUM_THREADS", None)  # torch's default threads, as a user runs it (module docstring)
    return env


def trl_grpo_steps(python: str, base: str, prompts_path: str, steps: int) -> dict:
    """bench/trl_grpo.py under the TRL venv: its JSON (per-step seconds, rewards, peak RSS, versions)."""
    cmd = [python, str(TRL_SCRIPT), "--base", base, "--prompts", prompts_path, "--steps", str(steps)]
    proc = subprocess.run(cmd, env=trl_env(), capture_output=True, text=True, timeout=TRL_TIMEOUT_S)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{TRL_SCRIPT.name} exit {proc.returncode}: {tail[:200]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trl_try(python: str | None, base: str, prompts_path: str, steps: int) -> dict | str | None:
    """One bench/trl_grpo.py run: its JSON, or why it failed (str); None without a TRL venv."""
    if python is None:
        return None
    try:
        return trl_grpo_steps(python, base, prompts_path, steps)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return str(e)[:240]


def trl_row(tries: list[dict | str | None], ours: float, ours_reward: float) -> dict:
    """Ours vs TRL's GRPOTrainer (the measured steps of every try pooled: one run before ours and one
    after, so a slow phase of the VM hits both sides alike), or a row saying why TRL was not measured."""
    if any(t is None for t in tries):
        return error_row(TRL_ROW, "unavailable: no TRL venv; `make bench-trl-env` creates .venv-trl "
                                  "(or set MILES_TRL_PYTHON)")  # fmt: skip
    failed = [t for t in tries if isinstance(t, str)]
    if failed:
        return error_row(TRL_ROW, failed[0])
    trl = tries[-1]
    v = trl["versions"]
    per_try = [t["step_seconds"][1:] or t["step_seconds"] for t in tries]
    trl_steps = [x for steps in per_try for x in steps]
    unit = (f"s/step (ratio: ours / TRL, goal <= 0.8; median of {len(trl_steps)} steps, {len(tries)} runs "
            f"after 1 warm-up each; TRL {v['trl']}, transformers {v['transformers']}, threads={trl['torch_threads']})")  # fmt: skip
    return row(TRL_ROW, ours, float(np.median(trl_steps)), unit, trl_peak_rss_mb=trl["peak_rss_mb"],
               trl_final_mean_reward=trl["final_mean_reward"], ours_final_mean_reward=ours_reward,
               trl_run_medians_s=[round(float(np.median(x)), 4) for x in per_try])  # fmt: skip


def _tree_rss_mb(proc) -> float:
    """RSS of a process and all its descendants (ours: driver, Ray's daemons, actors, engine)."""
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def timed_process(cmd: list[str], env: dict, log: str) -> tuple[float, float, str]:
    """(wall seconds from start to exit, peak RSS of its process tree sampled every 0.2 s, stdout)."""
    import psutil

    with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
        t0 = time.perf_counter()
        proc = psutil.Popen(cmd, env=env, stdout=out, stderr=err)
        peak = 0.0
        while proc.poll() is None:
            peak = max(peak, _tree_rss_mb(proc))
            time.sleep(0.2)
        wall = time.perf_counter() - t0
    text = Path(log + ".out").read_text()
    if proc.returncode != 0:
        tail = Path(log + ".err").read_text().strip().splitlines() or ["no output"]
        raise RuntimeError(f"{cmd[1:4]} exit {proc.returncode}: {tail[-1][:200]}")
    return wall, peak, text


def whole_runs(python: str, base: str, data: dict, root: str, recipe: dict) -> list[dict]:
    """Whole runs, process start to exit, WHOLE_STEPS steps per seed: `miles-platform train` (Ray,
    engine, trainer, shards, an HF export per version) vs TRL's GRPOTrainer (one process), the same
    base, prompts and recipe; both final policies then scored by the same greedy evaluator on the
    held-out split (outside the timed runs). Medians over the seeds; pass@1 mean and per seed."""
    import yaml

    from miles_platform.rollout.evaluate import greedy_pass_at_1

    env = project_env(OMP_NUM_THREADS="1")
    ours, trl = {"wall": [], "rss": [], "acc": []}, {"wall": [], "rss": [], "acc": []}
    overlap = {"wall": [], "rss": [], "acc": []}  # `train-async`: Miles' one-step overlap loop
    pinned = {"wall": [], "rss": [], "acc": []}  # `train-async --pin-trainer-cpus`
    for seed in WHOLE_SEEDS:
        d = os.path.join(root, f"whole{seed}")
        os.makedirs(d)
        for command, tag, out_of, extra in (("train", "ours", ours, {}), ("train-async", "overlap", overlap, {}),
                                            ("train-async", "pinned", pinned, {"pin_trainer_cpus": CORES >= 2})):  # fmt: skip
            cfg = {**recipe, "run_name": f"{tag}{seed}", "hf_checkpoint": base, "prompt_data": data["train"],
                   "num_rollout": WHOLE_STEPS, "seed": seed, "rollout_seed": seed, "save_interval": None,
                   "storage_root": os.path.join(d, f"root_{tag}"), **extra}  # fmt: skip
            Path(d, f"{tag}.yaml").write_text(yaml.safe_dump(cfg))
            cmd = [sys.executable, "-m", "miles_platform.cli", command, "--config", f"{d}/{tag}.yaml"]
            wall, rss, out = timed_process(cmd, env, os.path.join(d, tag))
            final = json.loads(out.strip().splitlines()[-1])["final_hf_path"]
            out_of["wall"].append(wall), out_of["rss"].append(rss)
            out_of["acc"].append(greedy_pass_at_1(final, data["eval"], WHOLE_EVAL_PROMPTS))
        save = os.path.join(d, "trl_final")
        cmd = [python, str(TRL_SCRIPT), "--base", base, "--prompts", data["train"], "--steps", str(WHOLE_STEPS),
               "--seed", str(seed), "--save", save]  # fmt: skip
        wall, rss, _ = timed_process(cmd, trl_env(), os.path.join(d, "trl"))
        trl["wall"].append(wall), trl["rss"].append(rss)
        trl["acc"].append(greedy_pass_at_1(save, data["eval"], WHOLE_EVAL_PROMPTS))
    base_acc = greedy_pass_at_1(base, data["eval"], WHOLE_EVAL_PROMPTS)
    what = f"{len(WHOLE_SEEDS)} seeds x {WHOLE_STEPS} steps, median"
    return [
        row("e2e: whole run wall, start to exit, train vs TRL GRPOTrainer", float(np.median(ours["wall"])),
            float(np.median(trl["wall"])), f"s (ratio: ours / TRL, goal <= 1.0; {what})",
            ours_s=[round(x, 1) for x in ours["wall"]], trl_s=[round(x, 1) for x in trl["wall"]]),
        row("e2e: whole run peak RSS of the process tree, train vs TRL", float(np.median(ours["rss"])),
            float(np.median(trl["rss"])), f"MB (ratio: ours / TRL; {what}; sampled every 0.2 s)",
            ours_mb=[round(x) for x in ours["rss"]], trl_mb=[round(x) for x in trl["rss"]]),
        row("e2e: held-out greedy pass@1 after the whole run, train vs TRL", float(np.mean(ours["acc"])),
            float(np.mean(trl["acc"])),
            f"pass@1 (ratio: ours / TRL, goal ~1 within seed noise; mean of {len(WHOLE_SEEDS)} seeds, "
            f"{WHOLE_EVAL_PROMPTS} prompts; base {base_acc:.3f})",
            ours_acc=[round(x, 3) for x in ours["acc"]], trl_acc=[round(x, 3) for x in trl["acc"]],
            base_acc=round(base_acc, 3)),
        row("e2e: whole run wall, start to exit, train-async vs TRL GRPOTrainer", float(np.median(overlap["wall"])),
            float(np.median(trl["wall"])), f"s (ratio: train-async / TRL, goal <= 1.0; {what})",
            ours_s=[round(x, 1) for x in overlap["wall"]], trl_s=[round(x, 1) for x in trl["wall"]],
            train_s=[round(x, 1) for x in ours["wall"]]),
        row("e2e: whole run wall, start to exit, train-async --pin-trainer-cpus vs TRL GRPOTrainer",
            float(np.median(pinned["wall"])), float(np.median(trl["wall"])),
            f"s (ratio: pinned train-async / TRL, goal <= 1.0; {what})",
            ours_s=[round(x, 1) for x in pinned["wall"]], trl_s=[round(x, 1) for x in trl["wall"]],
            overlap_s=[round(x, 1) for x in overlap["wall"]], pinned_acc=[round(x, 3) for x in pinned["acc"]]),
        row("e2e: held-out greedy pass@1 after the whole run, train-async vs train", float(np.mean(overlap["acc"])),
            float(np.mean(ours["acc"])),
            f"pass@1 (ratio: one-step overlap / on-policy, goal ~1 within seed noise; mean of {len(WHOLE_SEEDS)} "
            f"seeds, {WHOLE_EVAL_PROMPTS} prompts)",
            ours_acc=[round(x, 3) for x in overlap["acc"]], train_acc=[round(x, 3) for x in ours["acc"]]),
    ]  # fmt: skip


def run(rollouts: int = ROLLOUTS) -> list[dict]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from bench.bench_rollout import sft_base
    from miles_platform.config import RunConfig
    from miles_platform.loop import train
    from miles_platform.recipes import DEMO_RL

    torch.set_num_threads(1)
    # the short-SFT base samples at ~0.9 nats per token at T = 1: over --ci-test's entropy bound (Miles'
    # 0.7, for its CI models; the demo's 1200-iteration base is under it), which the checker reads
    # from rollout/entropy since 2026-12-05
    recipe = dict(DEMO_RL, ci_entropy_max=2.0)
    # ASYNC_CI: under --fully-async a sample may come from a version several updates old, so the
    # trainer's mean log-prob moves away from the engine's as fast as the policy learns (0.071 at
    # rollout 6 from the seed-5 short base, 2026-12-06); Miles applies its 0.03 bound there all the
    # same, so these timing runs turn the log-prob checker off (its other checks stay on)
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as d:
        base, data = sft_base(d)
        trl_tries = [trl_try(trl_python(), base, data["train"], rollouts)]  # and one after ours
        bare = bare_grpo_loop(base, data["train"], rollouts)[1:]
        cfg = RunConfig(
            **dict(recipe, run_name="bench_e2e"), hf_checkpoint=base, prompt_data=data["train"],
            num_rollout=rollouts, storage_root=os.path.join(d, "root"),
        ).validate()  # fmt: skip
        res = train(cfg)
        cfg_overlap = RunConfig(  # `miles-platform train-async`: rollout k+1 generates while k trains
            **dict(recipe, run_name="bench_e2e_overlap"), hf_checkpoint=base, prompt_data=data["train"],
            num_rollout=rollouts, storage_root=os.path.join(d, "root_overlap"), train_async=True,
        ).validate()  # fmt: skip
        res_overlap = train(cfg_overlap)
        # the same, the trainer on a core of its own, the engine and the driver on the other
        # (--pin-trainer-cpus, cluster/cpu_pinning.py): off by default, for CPU-only local runs
        cfg_pinned = RunConfig(
            **dict(recipe, run_name="bench_e2e_pinned"), hf_checkpoint=base, prompt_data=data["train"],
            num_rollout=rollouts, storage_root=os.path.join(d, "root_pinned"), train_async=True,
            pin_trainer_cpus=CORES >= 2,
        ).validate()  # fmt: skip
        res_pinned = train(cfg_pinned)
        cfg_async = RunConfig(
            **dict(recipe, run_name="bench_e2e_async"), hf_checkpoint=base, prompt_data=data["train"],
            num_rollout=rollouts, storage_root=os.path.join(d, "root_async"), fully_async=True,
            ci_disable_logprobs_checker=True,  # see ASYNC_CI above
        ).validate()  # fmt: skip
        res_async = train(cfg_async)
        cfg_group = RunConfig(
            **dict(recipe, run_name="bench_e2e_async_group"), hf_checkpoint=base, prompt_data=data["train"],
            num_rollout=rollouts, storage_root=os.path.join(d, "root_async_group"), fully_async=True,
            rollout_submission_granularity="group", ci_disable_logprobs_checker=True,
        ).validate()  # fmt: skip
        res_group = train(cfg_group)
        plain = {k: v for k, v in recipe.items() if not k.startswith("ci_")}  # TRL checks nothing of the kind
        cfg_plain = RunConfig(
            **dict(plain, run_name="bench_e2e_plain"), hf_checkpoint=base, prompt_data=data["train"],
            num_rollout=rollouts, storage_root=os.path.join(d, "root_plain"),
        ).validate()  # fmt: skip
        res_plain = train(cfg_plain)
        measured = res.metrics[1:] or res.metrics
        steps = [m["perf/rollout_total_time"] for m in measured]
        total, mean_total = float(np.median(steps)), float(np.mean(steps))
        reward = float(res.metrics[-1].get("rollout/raw_reward", float("nan")))
        trl_tries.append(trl_try(trl_python(), base, data["train"], rollouts))
        vs_trl = trl_row(trl_tries, total, reward)
        whole = []
        if trl_python() is not None and WHOLE_SEEDS:
            try:  # from the demo's SFT base (1200 iterations, past the loss plateau: RL has room to
                # learn; the short base above stays on the plateau, where 100 steps move neither side)
                from miles_platform.training.sft import default_sft_recipe, run_sft

                demo_base = os.path.join(d, "demo_base")
                run_sft(data["sft"], save=demo_base, recipe=default_sft_recipe(), progress=False)
                whole = whole_runs(trl_python(), demo_base, data, d, recipe)
            except (RuntimeError, json.JSONDecodeError, IndexError, KeyError) as e:
                whole = [
                    error_row("e2e: whole run wall, start to exit, train vs TRL GRPOTrainer", str(e)[:240])
                ]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = [row("e2e: s per GRPO step, loop.train vs bare single-process loop", total, float(np.median(bare)),
                f"s/step (ratio: ours / bare, goal <= 1.3; median of {len(measured)} steps after 1 warm-up)",
                peak_rss_mb=rss, ours_steps_s=[round(x, 4) for x in steps],
                bare_steps_s=[round(x, 4) for x in bare]), vs_trl]  # fmt: skip

    def median_step(r) -> float:
        return float(np.median([m["perf/rollout_total_time"] for m in (r.metrics[1:] or r.metrics)]))

    t_async, t_group, t_overlap = median_step(res_async), median_step(res_group), median_step(res_overlap)
    waits = [m.get("perf/rollout_wait_time", 0.0) for m in res_overlap.metrics[1:]]
    rows.append(row("e2e: s per GRPO step, train-async (one-step overlap) vs sync", t_overlap, total,
                    "s/step (ratio: overlap / sync; < 1 = overlap pays)", peak_rss_mb=rss,
                    overlap_steps_s=[round(m["perf/rollout_total_time"], 4) for m in res_overlap.metrics[1:]],
                    overlap_median_wait_s=round(float(np.median(waits)), 4)))  # fmt: skip
    if vs_trl.get("baseline"):  # the same TRL steps as the sync row's
        rows.append(row("e2e: s per GRPO step, train-async (one-step overlap) vs TRL GRPOTrainer", t_overlap,
                        vs_trl["baseline"], "s/step (ratio: overlap / TRL, goal <= 0.8; medians of the measured steps)",
                        peak_rss_mb=rss))  # fmt: skip
    t_pinned = median_step(res_pinned)
    rows.append(row("e2e: s per GRPO step, train-async --pin-trainer-cpus vs train-async", t_pinned, t_overlap,
                    f"s/step (ratio: pinned / not; < 1 = pinning pays; {'pinned' if CORES >= 2 else 'one core: not pinned'})",
                    pinned_steps_s=[round(m["perf/rollout_total_time"], 4) for m in res_pinned.metrics[1:]],
                    peak_rss_mb=rss))  # fmt: skip
    if vs_trl.get("baseline"):
        rows.append(row("e2e: s per GRPO step, train-async --pin-trainer-cpus vs TRL GRPOTrainer", t_pinned,
                        vs_trl["baseline"], "s/step (ratio: ours / TRL, goal <= 0.8; the same TRL steps)",
                        peak_rss_mb=rss))  # fmt: skip
    t_plain = median_step(res_plain)
    rows.append(row("e2e: s per GRPO step, train with --ci-test vs without", total, t_plain,
                    "s/step (ratio: the demo recipe's Miles CI checks: weight equality, entropy, checkers)",
                    peak_rss_mb=rss))  # fmt: skip
    if vs_trl.get("baseline"):
        rows.append(row("e2e: s per GRPO step, train without --ci-test vs TRL GRPOTrainer", t_plain,
                        vs_trl["baseline"], "s/step (ratio: ours / TRL, goal <= 0.8; the same TRL steps)",
                        peak_rss_mb=rss))  # fmt: skip
    rows.append(row("e2e: s per GRPO step, --fully-async vs sync (same samples per step)", t_async, total,
                    "s/step (ratio: async / sync; < 1 = overlap pays)", peak_rss_mb=rss))  # fmt: skip
    rows.append(row("e2e: s per GRPO step, --fully-async granularity sample vs group", t_async, t_group,
                    "s/step (ratio: sample / group; sample frees a slot per finished sample)",
                    peak_rss_mb=rss))  # fmt: skip
    unit = "s/step (ratio: share of our mean step; means over the measured steps)"
    covered = 0.0
    for key in PHASES:
        s = float(np.mean([m.get(key, 0.0) for m in measured]))
        covered += s
        rows.append(row(f"e2e: {key}", s, mean_total, unit))
    rows.append(
        row(
            "e2e: other (checks, metrics, eval, save, handoffs)",
            max(mean_total - covered, 0.0),
            mean_total,
            unit,
        )
    )
    print(json.dumps({"ci_checks": res.ci_checks}))
    return rows + whole


if __name__ == "__main__":
    main(run)
