"""PPO critic: the policy's transformer trunk + a scalar value head, trained on GAE returns.

The value of response token t is read at the position that predicts it (the same position
the policy's log-prob of t comes from), so values, log-probs and advantages line up token by
token. Value loss is Miles' clipped form: 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2).

More than one rank: every rank holds the whole critic (it is not sharded) and trains on its own
share of the batch; step() averages the gradients over ranks (one all-reduce of them all,
flattened) before clipping, so the replicas stay identical. An explicit all-reduce rather
than torch DDP: the critic's forward is two calls (trunk, head) that DDP would not see as one.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from miles_platform.config import RunConfig
from miles_platform.training.backend import all_reduce_grads
from miles_platform.training.checkpoint import load_optimizer_tensors, optimizer_tensors, rank_file
from miles_platform.weights.quantize import load_dense_hf_model


class Critic(torch.nn.Module):
    def __init__(self, cfg: RunConfig, hf_checkpoint: str, world_size: int = 1, device="cpu"):
        super().__init__()
        self.world_size = world_size
        lm = load_dense_hf_model(hf_checkpoint)
        self.trunk = lm.model  # Qwen3Model: no lm_head, so no vocab-sized logits are computed
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.to(device)  # the rank's device; the optimizer's state follows its parameters
        self.train()
        self.opt = torch.optim.AdamW(
            self.parameters(),
            lr=cfg.critic_lr or cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self.clip_grad = cfg.clip_grad

    def values(
        self, ids: torch.Tensor, pos: torch.Tensor, spans: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """Per-sample values of the response tokens; spans = (total_len, response_len) per row."""
        h = self.trunk(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).last_hidden_state
        v = self.head(h.float()).squeeze(-1)
        return [v[r, total - resp - 1 : total - 1] for r, (total, resp) in enumerate(spans)]

    def average_grads(self) -> None:
        """The mean of every parameter's gradient over the ranks (a zero gradient where unset)."""
        all_reduce_grads(self.parameters(), mean_over=self.world_size)

    def step(self) -> float:
        if self.world_size > 1:
            self.average_grads()
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), self.clip_grad)
        if torch.isfinite(norm):  # a NaN / inf value loss skips the step, as the policy's
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(norm)

    def save(self, ckpt_dir: str, rank: int, with_optimizer: bool = True) -> None:
        """Into the trainer's checkpoint dir (training/checkpoint.py): the critic once, its optimizer
        per rank (not with --no-save-optim)."""
        if rank == 0:
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()},
                os.path.join(ckpt_dir, "critic.safetensors"),
            )
        if not with_optimizer:
            return
        opt = optimizer_tensors(self.opt, self.named_parameters())
        save_file(opt, os.path.join(ckpt_dir, rank_file("critic_optimizer", rank)))

    def load(self, ckpt_dir: str, rank: int, with_optimizer: bool = True) -> None:
        self.load_state_dict(
            load_file(os.path.join(ckpt_dir, "critic.safetensors"))
        )  # copied onto the device
        if not with_optimizer:  # --no-load-optim
            return
        opt = load_file(os.path.join(ckpt_dir, rank_file("critic_optimizer", rank)))
        load_optimizer_tensors(self.opt, self.named_parameters(), opt)
