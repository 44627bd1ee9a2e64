"""The customization hooks a trainer rank calls (config/hooks.py), where Miles' actor calls them:

  --rollout-data-postprocess-path                after the old / ref log-probs and the advantages
                                                 (and their whitening), before the optimizer steps
  --custom-megatron-init-path                    once megatron's parallel state is up (MegatronBackend.build)
  --custom-megatron-before-train-step-hook-path  before each optimizer step of a rollout

(--custom-megatron-post-save-hook-path runs in the loop after a checkpoint and its --save-hf copy are
complete: loop.py.) Each is loaded once per rank by plugins.load_hook, which preflight ran before Ray
started, so a broken path never reaches a rank.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from miles_platform.plugins import load_hook


class TrainerHooks:
    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.postprocess = load_hook(cfg, "rollout_data_postprocess_path")
        self.before_step = load_hook(cfg, "custom_megatron_before_train_step_hook_path")
        required = 0
        if self.postprocess is not None:
            params = inspect.signature(self.postprocess).parameters.values()
            required = sum(
                p.default is inspect.Parameter.empty and p.kind.name.startswith("POSITIONAL") for p in params
            )
        self.postprocess_takes_data = (
            required >= 2
        )  # Miles' form is fn(args); fn(args, rollout_data) sees the data

    def postprocess_rollout(
        self, batch, mine: list[int], old: dict, ref: dict | None, rollout_lp: dict, adv: dict
    ) -> None:
        """--rollout-data-postprocess-path over this rank's samples `mine`. `rollout_data` holds per-sample
        lists in Miles' names; loss masks (float tensors) and advantages changed in place or replaced are
        what the steps train on."""
        if self.postprocess is None:
            return
        if not self.postprocess_takes_data:
            self.postprocess(self.cfg)
            return
        device = next(iter(adv.values())).device if adv else "cpu"
        data = {
            "tokens": [list(batch.tokens[i]) for i in mine],
            "response_lengths": [batch.response_lengths[i] for i in mine],
            "total_lengths": [len(batch.tokens[i]) for i in mine],
            "rewards": [batch.rewards[i] for i in mine],
            "sample_indices": [batch.sample_indices[i] for i in mine] if batch.sample_indices else None,
            "log_probs": [old[i] for i in mine] if old else None,
            "ref_log_probs": [ref[i] for i in mine] if ref is not None else None,
            "rollout_log_probs": [rollout_lp[i] for i in mine],
            "advantages": [adv[i] for i in mine],
            "loss_masks": [
                torch.tensor(batch.loss_masks[i], dtype=torch.float32, device=device) for i in mine
            ],
        }
        self.postprocess(self.cfg, data)
        for i, m, a in zip(mine, data["loss_masks"], data["advantages"], strict=True):
            batch.loss_masks[i] = [int(x) for x in torch.as_tensor(m).tolist()]
            adv[i] = torch.as_tensor(a, dtype=adv[i].dtype, device=adv[i].device)

    def before_train_step(self, rollout_id: int, step_id: int, model, optimizer, scheduler) -> None:
        """--custom-megatron-before-train-step-hook-path: Miles' (args, rollout_id, step_id, model,
        optimizer, opt_param_scheduler); `model` is the rank's list of megatron model chunks."""
        if self.before_step is not None:
            self.before_step(self.cfg, rollout_id, step_id, model, optimizer, scheduler)


def megatron_init_hook(cfg: Any) -> None:
    """--custom-megatron-init-path: Miles' custom_init(args), once megatron's parallel state is up."""
    fn = load_hook(cfg, "custom_megatron_init_path")
    if fn is not None:
        fn(cfg)


def post_save_hook(cfg: Any, rollout_id: int, checkpoint_dir: str, hf_checkpoint_dir: str | None) -> None:
    """--custom-megatron-post-save-hook-path: Miles' hook(args, rollout_id, checkpoint_dir,
    hf_checkpoint_dir), once the checkpoint (and its --save-hf copy) is complete."""
    fn = load_hook(cfg, "custom_megatron_post_save_hook_path")
    if fn is not None:
        fn(cfg, rollout_id, checkpoint_dir, hf_checkpoint_dir)
