"""The small RL run the loop-level tests share: 8 addition prompts, 2 prompts x 2 samples, 2 rollouts."""

import json
import os

from miles_platform.config import RunConfig
from miles_platform.rollout.data_buffer import DefaultDataBuffer


def write_prompts(tmp_path, n: int = 8) -> str:
    p = tmp_path / "train.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(n)))
    return str(p)


def chat_rows(n: int = 8) -> list[dict]:
    """Multi-turn conversations (Miles' SFT data: `messages` of system / user / assistant / tool turns)."""
    rows = []
    for i in range(n):
        rows.append({"messages": [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": f"{i}+{i}="},
            {"role": "assistant", "content": f"calc {i}+{i}"},
            {"role": "tool", "content": str(2 * i)},
            {"role": "assistant", "content": str(2 * i)},
            {"role": "user", "content": "and doubled?"},
            {"role": "assistant", "content": str(4 * i)},
        ][: 5 if i % 2 else 7]})  # fmt: skip
    return rows


def write_chat_data(tmp_path, n: int = 8) -> str:
    p = tmp_path / "chat.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(n)))
    return str(p)


def sft_argv(ckpt: str, data: str, *more: str) -> list[str]:
    """`train` argv of Miles' SFT recipe (its run-*-sft.sh): the SFT rollout function over `messages`."""
    return ["--hf-checkpoint", ckpt, "--prompt-data", data, "--input-key", "messages",
            "--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss",
            "--calculate-per-token-loss", "--disable-compute-advantages-and-returns", "--debug-train-only",
            "--rollout-batch-size", "4", "--global-batch-size", "4", *more]  # fmt: skip


# the tiny test models are untrained: near-uniform, their mean token entropy ~ 5 nats
UNTRAINED_ENTROPY_MAX = 10.0


def small_run_kwargs(ckpt: str, tmp_path, **overrides) -> dict:
    """The RunConfig keyword arguments of the small run, unvalidated (for tests of validation itself)."""
    base = dict(
        hf_checkpoint=ckpt,
        prompt_data=write_prompts(tmp_path),
        input_key="prompt",
        label_key="label",
        rm_type="math",
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        num_rollout=2,
        rollout_max_response_len=4,
        lr=1e-3,
        storage_root=str(tmp_path / "root"),
        run_name="t",
        num_cpus_per_actor=0.5,
    )
    if overrides.get("ci_test"):  # --ci-test's entropy bound is Miles' 0.7, for trained models
        base["ci_entropy_max"] = UNTRAINED_ENTROPY_MAX
    base.update(overrides)
    return base


def small_run_config(ckpt: str, tmp_path, **overrides) -> RunConfig:
    return RunConfig(**small_run_kwargs(ckpt, tmp_path, **overrides)).validate()


def newest_first(args, rollout_id, buffer, num_samples):
    """A `--buffer-filter-path` for the tests: pops the newest groups and tags what it picked."""
    picked = [buffer.pop() for _ in range(min(num_samples, len(buffer)))]
    for group in picked:
        for s in group:
            s.metadata["picked_by"] = "newest_first"
    return picked


def record_post_write(args, version_dir, engines):
    """A `--custom-update-weight-post-write-path` for the tests: logs what it was handed and what a
    reader of the publication dir sees at that moment."""
    import os

    from miles_platform.weights.disk_delta import read_latest

    row = {"dir": os.path.basename(version_dir), "latest": read_latest(os.path.dirname(version_dir)),
           "exists": os.path.isdir(version_dir), "engines": len(engines)}  # fmt: skip
    with open(f"{args.update_weight_disk_dir}.post_write_hook.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def record_rollout_log(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """A `--custom-rollout-log-function-path` for the tests: records what Miles' signature hands it,
    adds a metric at rollout 0 and takes over (returns True) the default logging of rollout 1."""
    row = {"rollout_id": rollout_id, "args": type(args).__name__, "run": args.run_name,
           "samples": [type(s).__name__ for s in samples], "metrics": sorted(rollout_extra_metrics),
           "rollout_time": rollout_time, "perf_rollout_time": rollout_extra_metrics.get("perf/rollout_time")}  # fmt: skip
    os.makedirs(args.storage_root, exist_ok=True)
    with open(f"{args.storage_root}/rollout_log_calls.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    if rollout_id == 0:
        rollout_extra_metrics["rollout/custom_reward_x2"] = 2 * rollout_extra_metrics["rollout/raw_reward"]
    return rollout_id == 1


def record_eval_log(rollout_id, args, data, extra_metrics):
    """A `--custom-eval-rollout-log-function-path` for the tests: records its arguments and takes
    over the default logging of the eval after rollout 1."""
    row = {
        "rollout_id": rollout_id,
        "args": type(args).__name__,
        "data": data,
        "metrics": sorted(extra_metrics),
    }
    os.makedirs(args.storage_root, exist_ok=True)
    with open(f"{args.storage_root}/eval_log_calls.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return rollout_id == 1


def random_train_batch(seed: int = 0, rewards: list[float] | None = None):
    """4 samples of random tokens (prompts of 3-4, responses of 2-5): the trainer tests' batch.
    `rewards` default: random in [0, 1) from the same generator."""
    import torch

    from miles_platform.training.actor import TrainBatch

    g = torch.Generator().manual_seed(seed)
    toks, lens = [], []
    for i in range(4):
        p, r = 3 + i % 2, 2 + i
        toks.append(torch.randint(3, 60, (p + r,), generator=g).tolist())
        lens.append(r)
    rewards = torch.rand(4, generator=g).tolist() if rewards is None else rewards
    return TrainBatch(toks, lens, [[1] * n for n in lens], rewards, [[0.0] * n for n in lens])


def crash_once_at_rollout_3(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """A `--custom-rollout-log-function-path` that fails the run once, at rollout 3 (after the
    version of rollout 2 was recorded past the rollout-1 checkpoint); the retry goes through."""
    marker = os.path.join(args.storage_root, "crashed_once")
    if rollout_id == 3 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("injected failure at rollout 3")
    return False


async def first_token_parity_rm(args, sample):
    """A `--custom-rm-path` for the tests: a reward a tiny random policy gets about half the time,
    so a group has reward variance and GRPO moves the weights."""
    return float(bool(sample.response_tokens) and sample.response_tokens[0] % 2 == 0)


def engine_rollout(ckpt: str, prompts, new_tokens, routes: bool, check=None) -> list[dict]:
    """Each prompt twice (GRPO groups of 2) through an in-process EngineCore at T = 1, seeded per row,
    `new_tokens[i]` tokens each (EOS ignored), log-probs and (`routes`) routed experts returned: the
    /generate answers. `check(core)` runs before the engine stops."""
    from miles_platform.rollout.engine_core import EngineCore

    core = EngineCore(ckpt, num_threads=1, max_batch_size=4)
    try:
        body = {"input_ids": [p for p in prompts for _ in range(2)], "return_logprob": True,
                "return_routed_experts": routes,
                "sampling_params": [{"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i}
                                    for i, n in enumerate(new_tokens)]}  # fmt: skip
        futures, _ = core.submit_json(body)
        outs = [f.result(120) for f in futures]
        if check is not None:
            check(core)
    finally:
        core.stop()
    return outs


def warm_python() -> list[str]:
    """`python` for a test's subprocess script: a fork of this pytest process's fork server (torch,
    transformers, PEFT and megatron-core already imported; cluster/forkserver.py), else the
    interpreter. The script runs as it would under `python`: same env, args, cwd and exit status."""
    from miles_platform.cluster import forkserver, ray_cluster

    ray_cluster.start_fork_server(*forkserver.EXTRAS)  # every extra, as the shared fixture's
    return forkserver.warm_python()


def spawn_ranks(fn, args: tuple, nprocs: int, join: bool = True):
    """`torch.multiprocessing.spawn` for gloo-rank tests (its `start_processes`), as forks of the stdlib
    fork server with the trainer's imports preloaded (cluster/forkserver.py `rank_context`, as a
    conversion's ranks): not fresh interpreters that import torch and megatron-core again; `fn` and
    `args` are pickled exactly as with spawn."""
    import torch.multiprocessing as mp

    from miles_platform.cluster.forkserver import rank_context

    rank_context()
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")


def run_ranks(fn, args: tuple, nprocs: int, out) -> None:
    """`spawn_ranks` into `out` (made here) and wait for every rank; a rank's `<out>/*.error` file
    (its traceback, written by the worker) fails the test with the first one."""
    out.mkdir(parents=True)
    ctx = spawn_ranks(fn, args, nprocs, join=False)
    while not ctx.join():
        pass
    errors = [p.read_text() for p in sorted(out.glob("*.error"))]
    assert not errors, errors[0]


async def broken_reward(args, sample):
    """A `--custom-rm-path` with a bug: it raises on every sample."""
    raise KeyError("score")


class RecordingBuffer(DefaultDataBuffer):
    """A `--custom-async-data-buffer-path` for the tests: the default buffer, every call recorded."""

    calls: list[tuple] = []

    def put(self, input):
        self.calls.append(("put", input.uid))
        return super().put(input)

    def get(self, num_groups, current_version=None):
        self.calls.append(("get", num_groups, current_version))
        return super().get(num_groups, current_version)

    def get_metrics(self, trainer_model_id=None):
        self.calls.append(("get_metrics", trainer_model_id))
        return {**super().get_metrics(trainer_model_id), "custom/buffer_calls": float(len(self.calls))}

    def state_dict(self):
        self.calls.append(("state_dict",))
        return {**super().state_dict(), "recorded": True}

    def load_state_dict(self, state):
        self.calls.append(("load_state_dict",))
        return super().load_state_dict(state)


def square_image_uri(color, size: int, box: tuple[int, int, int, int]) -> str:
    """A black `size` x `size` PNG with a `color` square at `box`, as a data URI (the VLM tests' images)."""
    import io

    from PIL import Image

    from miles_platform.data.images import to_data_uri

    img = Image.new("RGB", (size, size), (0, 0, 0))
    img.paste(color, box)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return to_data_uri(buf.getvalue())
