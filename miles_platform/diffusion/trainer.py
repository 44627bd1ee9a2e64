"""The diffusion trainer: the DiT under FSDP2 with the dtype contract, Flow-GRPO and DiffusionNFT steps.

Flow-GRPO re-scores the recorded `x_t -> x_{t+1}` transitions through the SDE step backend of
`--diffusion-sde-type` (the engine steps with the same class), so before the first optimizer step
the ratio is 1 up to forward-precision noise. DiffusionNFT re-noises each final image at the
rollout's sigmas and trains against the EMA (`pi_old`, also what the engine serves).

Batching, per Miles: `global_batch_size` trajectories per optimizer step; each contributes its
trained timesteps, so pairs_per_optimizer_step = global_batch_size x trained_timesteps_per_trajectory;
`micro_batch_size` pairs per DiT forward, gradients accumulated over the step.
"""

from __future__ import annotations

import copy
import json
import os
import time
from typing import Any

import torch

from miles_platform.diffusion.config import DiffusionRunConfig
from miles_platform.diffusion.family import TINY_DIT, dit_forward, precision_policy
from miles_platform.training.precision import alignment_metrics

STATE = "state.json"  # a checkpoint's marker: the loop's extra state, the optimizer step, the RNG
ADAM_STATE = ("exp_avg", "exp_avg_sq")  # the step is the trainer's own count (state.json)


def _full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 full tensors of a (possibly FSDP2-sharded) module, keyed by its own parameter names."""
    out = {}
    for k, v in module.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().to(torch.float32).contiguous().clone()
    return out


class DiffusionTrainer:
    def __init__(
        self, cfg: DiffusionRunConfig, hf_checkpoint: str | None = None, num_threads: int | None = None
    ):
        from miles_platform.diffusion.model import load_pipeline
        from miles_platform.diffusion.sde import backend_for
        from miles_platform.training.fsdp import shard_model

        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.pipe = load_pipeline(hf_checkpoint or cfg.hf_checkpoint)
        self.text_encoder = self.pipe.text_encoder.eval().requires_grad_(False)
        self.policy = precision_policy(cfg)
        base = self.pipe.transformer
        self.ref = copy.deepcopy(base).eval().requires_grad_(False) if cfg.diffusion_kl_beta > 0 else None
        self.ema = copy.deepcopy(base).eval().requires_grad_(False) if cfg.use_ema else None
        self.model = shard_model(base.train(), self.policy)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay)  # fmt: skip
        self.backend = backend_for(cfg.diffusion_sde_type, cfg.sde_step_backend_path,
                                   log_prob_no_const=cfg.diffusion_log_prob_no_const)  # fmt: skip
        self.step = 0  # optimizer steps so far (the EMA decay schedule counts them)

    # ------------------------------------------------------------------ train
    def train(self, rollout_id: int, data: dict[str, Any]) -> dict[str, float]:
        t0 = time.time()
        c = self.cfg
        n = len(data["prompts"])
        gbs = min(c.global_batch_size, n)
        cond, pooled = self.text_encoder(data["prompts"])
        metrics: dict[str, list[float]] = {}
        first = True
        for s in range(max(1, n // gbs)):
            idx = torch.arange(s * gbs, min((s + 1) * gbs, n))
            if c.loss_type == "nft":
                m = self._nft_step(data, idx, cond, pooled, rollout_id)
            else:
                m = self._grpo_step(data, idx, cond, pooled, first)
            first = False
            for k, v in m.items():
                metrics.setdefault(k, []).append(v)
        out = {k: sum(v) / len(v) for k, v in metrics.items()}
        out["train/step"] = float(self.step)
        out["perf/actor_train_time"] = time.time() - t0
        return out

    def _optimizer_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        if self.ema is not None:
            from miles_platform.diffusion.losses import ema_decay

            c = self.cfg
            decay = ema_decay(self.step, init=c.ema_decay_init, ramp=c.ema_decay_ramp, max=c.ema_decay_max,
                              flat_steps=c.ema_decay_flat_steps)  # fmt: skip
            full = _full_state(self.model)  # the sharded actor as full tensors
            with torch.no_grad():
                for name, sh in self.ema.named_parameters():
                    sh.mul_(decay).add_(full[name], alpha=1.0 - decay)
        return grad_norm

    def _micro_batches(self, n_pairs: int):
        mbs = self.cfg.micro_batch_size
        return [slice(i, min(i + mbs, n_pairs)) for i in range(0, n_pairs, mbs)]

    def _grpo_step(self, data, idx, cond, pooled, first: bool) -> dict[str, float]:
        from miles_platform.diffusion.losses import flow_grpo_loss, kl_to_ref

        c = self.cfg
        k = data["log_probs"].shape[1]
        if k == 0:
            raise ValueError("Flow-GRPO: the rollout recorded no transitions (step strategy returned none)")
        # pairs of this optimizer step: (trajectory, transition), trajectory-major
        traj = idx.repeat_interleave(k)
        step = torch.arange(k).repeat(len(idx))
        fields = {name: data[name][traj, step] for name in ("latents", "next_latents", "log_probs", "sigmas",
                                                               "next_sigmas")}  # fmt: skip
        sigma_max, adv = data["sigma_max"][traj], data["advantages"][traj]
        old = fields["log_probs"].float()
        if c.diffusion_recompute_old_log_prob:
            with torch.no_grad():
                old = self._log_probs(fields, sigma_max, cond[traj], pooled[traj], self.model)[0]
        n_pairs, sums, new_all, v_all = len(traj), {}, [], []
        for mb in self._micro_batches(n_pairs):
            f = {k2: v[mb] for k2, v in fields.items()}
            new, mean, std, v = self._log_probs(
                f, sigma_max[mb], cond[traj[mb]], pooled[traj[mb]], self.model
            )
            loss, m = flow_grpo_loss(new, old[mb], adv[mb], clip_range=c.diffusion_clip_range,
                                     adv_clip_max=c.diffusion_adv_clip_max)  # fmt: skip
            if self.ref is not None:
                with torch.no_grad():
                    _, ref_mean, _, _ = self._log_probs(
                        f, sigma_max[mb], cond[traj[mb]], pooled[traj[mb]], self.ref
                    )
                kl = kl_to_ref(mean, ref_mean, std).mean()
                loss = loss + c.diffusion_kl_beta * kl
                m["train/kl_loss"] = float(kl)
            if not c.debug_skip_optimizer_step:
                (loss * (mb.stop - mb.start) / n_pairs).backward()
            w = (mb.stop - mb.start) / n_pairs
            m["train/loss"] = float(loss.detach())
            for k2, v2 in m.items():
                sums[k2] = sums.get(k2, 0.0) + w * float(v2)
            new_all.append(new.detach())
            v_all.append(v.detach())
        if first:  # before this rollout's first optimizer step: the train/rollout alignment probe
            sums.update(alignment_metrics(torch.cat(new_all), old, torch.ones(n_pairs)))
            if data.get("model_output") is not None:
                sums.update(_output_diff(torch.cat(v_all), data["model_output"][traj, step]))
        if not c.debug_skip_optimizer_step:
            sums["train/grad_norm"] = self._optimizer_step()
        return sums

    def _log_probs(self, f, sigma_max, cond, pooled, model):
        c = self.cfg
        v = dit_forward(model, f["latents"], f["sigmas"], cond, pooled, c.diffusion_forward_dtype, TINY_DIT)
        out = self.backend.sde_step_logprob(f["latents"], v, f["sigmas"], f["next_sigmas"], sigma_max,
                                            c.diffusion_noise_level, prev_sample=f["next_latents"],
                                            log_prob_no_const=c.diffusion_log_prob_no_const)  # fmt: skip
        return out.log_prob, out.prev_mean, out.std_dev_t, v  # std_dev_t: flow_grpo's KL scale

    def _nft_step(self, data, idx, cond, pooled, rollout_id: int) -> dict[str, float]:
        from miles_platform.diffusion.losses import nft_loss, nft_reward_weight
        from miles_platform.diffusion.rollout import nft_strategy

        c = self.cfg
        grid = data["sigma_grid"]
        num_steps = len(grid) - 1
        strategy = nft_strategy(c)
        traj, sig, noises = [], [], []
        for i in idx.tolist():  # per sample: its own seeded generator (steps and re-noising)
            g = torch.Generator().manual_seed(c.seed * 1_000_003 + rollout_id * 65_537 + i)
            for t in strategy(c, num_steps, g):
                traj.append(i)
                sig.append(float(grid[t]))
                noises.append(torch.randn(data["images"].shape[1:], generator=g))
        traj_t, sigma = torch.tensor(traj), torch.tensor(sig, dtype=torch.float32)
        x0 = data["images"][traj_t].float()
        eps = torch.stack(noises)
        x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
        r = nft_reward_weight(data["advantages"][traj_t], c.diffusion_adv_clip_max)
        n_pairs, sums = len(traj), {}
        for mb in self._micro_batches(n_pairs):
            cm, pm = cond[traj_t[mb]], pooled[traj_t[mb]]
            v = dit_forward(self.model, x_t[mb], sigma[mb], cm, pm, c.diffusion_forward_dtype, TINY_DIT)
            with torch.no_grad():
                v_old = dit_forward(self.ema, x_t[mb], sigma[mb], cm, pm, c.diffusion_forward_dtype, TINY_DIT)
                v_ref = (dit_forward(self.ref, x_t[mb], sigma[mb], cm, pm, c.diffusion_forward_dtype, TINY_DIT)
                         if self.ref is not None else None)  # fmt: skip
            loss, m = nft_loss(v, v_old, x_t[mb], x0[mb], sigma[mb], r[mb], beta=c.diffusion_nft_beta,
                               adv_clip_max=c.diffusion_adv_clip_max,
                               adaptive_weight=not c.no_diffusion_nft_adaptive_weight,
                               kl_beta=c.diffusion_kl_beta, v_ref=v_ref)  # fmt: skip
            w = (mb.stop - mb.start) / n_pairs
            if not c.debug_skip_optimizer_step:
                (loss * w).backward()
            m["train/loss"] = float(loss.detach())
            for k2, v2 in m.items():
                sums[k2] = sums.get(k2, 0.0) + w * float(v2)
        sums["train/pairs_per_optimizer_step"] = float(n_pairs)
        if not c.debug_skip_optimizer_step:
            sums["train/grad_norm"] = self._optimizer_step()
        return sums

    # ------------------------------------------------------------------ weights and checkpoints
    def rollout_state(self) -> dict[str, torch.Tensor]:
        """The weights the engine serves: the EMA with --rollout-weights ema, else the actor."""
        return _full_state(self.ema if self.cfg.rollout_weights == "ema" else self.model)

    def export(self, path: str) -> str:
        """The version's pipeline dir (diffusers layout) with the rollout weights."""
        from miles_platform.diffusion.model import DiTPipeline, save_pipeline

        if os.path.exists(os.path.join(path, "transformer", "diffusion_pytorch_model.safetensors")):
            return path  # a crashed run exported it already: same version, same weights
        out = copy.deepcopy(self.ema) if self.ema is not None else _fresh_dit(self.pipe.transformer.config)
        out.load_state_dict(self.rollout_state())
        save_pipeline(DiTPipeline(out.float(), self.text_encoder, self.pipe.flow_shift), path)
        return path

    def save(self, save_dir: str, rollout_id: int, extra: dict[str, Any]) -> str:
        """Miles' layout through the trainers' checkpointer (training/checkpoint.py): iter_NNNNNNN/
        complete first, state.json its last file, then latest_checkpointed_iteration.txt."""
        from safetensors.torch import save_file

        from miles_platform.training.checkpoint import Checkpointer, optimizer_tensors

        opt_meta: dict[str, Any] = {"step": self.step}

        def write_files(d: str) -> None:
            save_file(_full_state(self.model), f"{d}/model.safetensors")
            if self.ema is not None:
                save_file(_full_state(self.ema), f"{d}/ema.safetensors")
            if not self.cfg.no_save_optim:
                tensors = optimizer_tensors(self.opt, self.model.named_parameters(), sep=".", keys=ADAM_STATE,
                                            full=True)  # fmt: skip
                opt_meta["params"] = [n for n, p in self.model.named_parameters() if p in self.opt.state]
                save_file(tensors, f"{d}/optimizer.safetensors")

        def write_state(d: str) -> None:
            state = {
                **extra,
                "rollout_id": rollout_id,
                "optimizer": opt_meta,
                "rng": torch.get_rng_state().tolist(),
            }
            with open(f"{d}/{STATE}", "w") as f:
                json.dump(state, f)

        return Checkpointer(save_dir, marker=STATE).save(rollout_id, write_files, write_state)

    def load(self, ckpt: str) -> dict[str, Any]:
        from safetensors.torch import load_file

        from miles_platform.training.checkpoint import load_optimizer_tensors

        with open(f"{ckpt}/{STATE}") as f:
            state = json.load(f)
        _load_into(self.model, load_file(f"{ckpt}/model.safetensors"))
        if self.ema is not None and os.path.exists(f"{ckpt}/ema.safetensors"):
            self.ema.load_state_dict(load_file(f"{ckpt}/ema.safetensors"))
        self.step = int(state["optimizer"]["step"])
        if not self.cfg.no_load_optim and os.path.exists(f"{ckpt}/optimizer.safetensors"):
            tensors = load_file(f"{ckpt}/optimizer.safetensors")
            load_optimizer_tensors(self.opt, self.model.named_parameters(), tensors, sep=".", full=True)
            for n, p in self.model.named_parameters():
                if f"{n}.exp_avg" in tensors:  # Adam's step count is the trainer's
                    self.opt.state[p]["step"] = torch.tensor(float(self.step))
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
        return state

    def dtype_census(self) -> dict[str, Any]:
        """Every module's IO dtypes in one trainer forward (training/precision_census.py)."""
        from miles_platform.training.precision_census import dtype_census

        x = torch.randn(2, self.pipe.transformer.config.in_channels, 16, 16)
        cond, pooled = self.text_encoder(["a red square in the top left"] * 2)

        def run():
            with torch.no_grad():
                return dit_forward(self.model, x, torch.tensor([0.5, 0.9]), cond, pooled,
                                   self.cfg.diffusion_forward_dtype)  # fmt: skip

        census = dtype_census(self.model, run, self.cfg.diffusion_forward_dtype)
        return {**census.to_json(), "modules": census.modules}


def _fresh_dit(config) -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_config(config)


def _load_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in model.state_dict().items():
            src = state[k].to(v.dtype)
            if hasattr(v, "full_tensor"):
                from torch.distributed.tensor import distribute_tensor

                v.copy_(distribute_tensor(src, v.device_mesh, v.placements))
            else:
                v.copy_(src)


def _output_diff(train_v: torch.Tensor, rollout_v: torch.Tensor) -> dict[str, float]:
    d = (train_v.double() - rollout_v.double()).abs()
    scale = rollout_v.double().abs().max().clamp_min(1e-12)
    return {"train/model_output_mean_abs_diff": float(d.mean()), "train/model_output_max_abs_diff": float(d.max()),
            "train/model_output_rel_max": float(d.max() / scale)}  # fmt: skip


class DiffusionTrainerActor:
    """Ray actor body around DiffusionTrainer (ray.remote(DiffusionTrainerActor))."""

    def __init__(self, cfg_dict: dict[str, Any], num_threads: int | None = None):
        cfg = DiffusionRunConfig.from_dict(cfg_dict).validate()
        self.t = DiffusionTrainer(cfg, num_threads=num_threads)

    def train(self, rollout_id: int, data: dict[str, Any]) -> dict[str, float]:
        return self.t.train(rollout_id, data)

    def export(self, path: str) -> str:
        return self.t.export(path)

    def save(self, save_dir: str, rollout_id: int, extra: dict[str, Any]) -> str:
        return self.t.save(save_dir, rollout_id, extra)

    def load(self, ckpt: str) -> dict[str, Any]:
        return self.t.load(ckpt)

    def dtype_census(self) -> dict[str, Any]:
        return self.t.dtype_census()
