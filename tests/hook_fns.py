"""Customization hooks (config/hooks.py) the hook tests load by dotted path, each with the signature
Miles documents; each records its calls in CALLS so a test can check what it was given."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

CALLS: dict[str, list] = {}
DIVISOR = 1000.0  # Dr.GRPO's constant (Miles' examples/experimental/DrGRPO/custom_reducer.py)


def _record(name: str, *args) -> None:
    CALLS.setdefault(name, []).append(args)


def _log(args, name: str, **fields) -> None:
    """One JSON line in <storage root>/hooks.jsonl: what a hook in a Ray actor saw (the test reads it)."""
    os.makedirs(args.storage_root, exist_ok=True)
    with open(os.path.join(args.storage_root, "hooks.jsonl"), "a") as f:
        f.write(json.dumps({"hook": name, "pid": os.getpid(), **fields}) + "\n")


def get_pg_loss_reducer(
    total_lengths: list[int],
    response_lengths: list[int],
    loss_masks: list[torch.Tensor],
    calculate_per_token_loss: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Dr.GRPO: each sample's masked sum over a constant, summed over the micro-batch (as Miles' example)."""
    _record("reducer", list(total_lengths), list(response_lengths), calculate_per_token_loss)
    if calculate_per_token_loss:
        return lambda x: sum(
            (xi * m).sum() for xi, m in zip(x.split(response_lengths), loss_masks, strict=True)
        )
    return lambda x: sum(
        (xi * m).sum() / DIVISOR for xi, m in zip(x.split(response_lengths), loss_masks, strict=True)
    )


def all_samples_process(args, all_samples, data_source) -> None:
    _record("all_samples", args, [[s.reward for s in g] for g in all_samples], data_source)
    _log(args, "all_samples", groups=[len(g) for g in all_samples], source=type(data_source).__name__)


def postprocess_args_only(args) -> None:
    _record("postprocess_args", args)


def postprocess_mask_first_token(args, rollout_data) -> None:
    """Masks the first response token of every sample (what Miles' hook is for: loss masks from log-probs)."""
    _record("postprocess", args, {k: len(v) for k, v in rollout_data.items() if v is not None})
    for m in rollout_data["loss_masks"]:
        m[0] = 0


def convert_samples_to_train_data(args, samples) -> dict:
    """Miles' default conversion, but every reward doubled (so a test sees the function was used)."""
    _record("convert", args, len(samples))
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [2.0 * (s.raw_reward or 0.0) for s in samples],
        "raw_reward": [s.raw_reward for s in samples],
        "truncated": [s.status == "truncated" for s in samples],
        "sample_indices": [s.index for s in samples],
        "loss_masks": [list(s.loss_mask) for s in samples],
        "rollout_log_probs": [list(s.rollout_log_probs) for s in samples],
    }


def reward_post_process(args, samples):
    """A --custom-reward-post-process-path: keeps the raw rewards as the trained ones, minus 0.5 (no
    group normalization), recording the call."""
    _record("reward_post_process", len(samples))
    raw = [s.raw_reward for s in samples]
    return raw, [r - 0.5 for r in raw]


def megatron_init(args) -> None:
    from megatron.core import parallel_state

    _log(args, "megatron_init", tp=parallel_state.get_tensor_model_parallel_world_size())


def megatron_before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    _log(args, "megatron_before_step", rollout_id=rollout_id, step_id=step_id,
         model=[type(m).__name__ for m in model], optimizer=type(optimizer).__name__,
         lr=opt_param_scheduler.get_last_lr()[0])  # fmt: skip


def megatron_post_save(args, rollout_id: int, checkpoint_dir: str, hf_checkpoint_dir: str | None) -> None:
    done = os.path.exists(os.path.join(os.path.dirname(checkpoint_dir), "latest_checkpointed_iteration.txt"))
    hf = hf_checkpoint_dir and os.path.exists(os.path.join(hf_checkpoint_dir, "model.safetensors"))
    _log(args, "megatron_post_save", rollout_id=rollout_id, checkpoint_dir=checkpoint_dir,
         hf_checkpoint_dir=hf_checkpoint_dir, complete=bool(done and os.path.isdir(checkpoint_dir)), hf_written=bool(hf))  # fmt: skip


def two_args(a, b) -> None:
    """The wrong arity for most hooks."""


class JsonlDataSource:
    """Miles' DataSource contract over --prompt-data (keys prompt / label), in order, with a buffer for
    add_samples; save / load record the rollout id (and log it)."""

    def __init__(self, args):
        with open(args.prompt_data) as f:
            self.dataset = [json.loads(line) for line in f if line.strip()]
        self.args, self.offset, self.buffer = args, 0, []

    def get_samples(self, num_samples: int) -> list[list]:
        from miles_platform.data.sample import Sample

        out = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        while len(out) < num_samples:
            row = self.dataset[self.offset % len(self.dataset)]
            out.append([Sample(prompt=row["prompt"], label=row["label"], index=self.offset)
                        for _ in range(self.args.n_samples_per_prompt)])  # fmt: skip
            self.offset += 1
        return out

    def add_samples(self, samples: list[list]) -> None:
        self.buffer += samples

    def save(self, rollout_id) -> None:
        _log(self.args, "data_source_save", rollout_id=rollout_id, offset=self.offset)

    def load(self, rollout_id=None) -> None:
        _log(self.args, "data_source_load", rollout_id=rollout_id)
        self.offset = (rollout_id + 1) * self.args.rollout_batch_size  # what the saved run had taken


def eval_rollout(args, rollout_id, data_source, evaluation=False):
    """An --eval-function-path function (Miles' rollout shape, called with evaluation=True)."""
    from miles_platform.rollout.base_types import RolloutFnEvalOutput

    _record("eval", rollout_id, evaluation, data_source)
    data = {"d": {"rewards": [1.0, None, 0.0, 1.0], "truncated": [False, True, False, False]}}
    return RolloutFnEvalOutput(data=data, metrics={"eval/extra": 3.0})


def rollout_without_evaluation(args, rollout_id, data_source):
    """A rollout function Miles could not call for eval (no `evaluation` parameter)."""


def custom_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
               response_lengths, **kwargs):  # fmt: skip
    """Miles' --custom-tis-function-path signature: halves every token's pg loss, drops each sample's
    first token from the loss, reports a per-token metric."""
    _record("tis", [len(t) for t in train_log_probs], [len(t) for t in rollout_log_probs], total_lengths,
            list(response_lengths), sorted(kwargs))  # fmt: skip
    masks = [m.clone() for m in loss_masks]
    for m in masks:
        m[0] = 0
    return pg_loss * 0.5, masks, {"my_tis_weight": torch.full_like(pg_loss, 0.5)}


def tis_two_args(args, pg_loss):
    return pg_loss, [], {}
