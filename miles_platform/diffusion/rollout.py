"""Diffusion rollout: prompts -> microgroup requests -> recorded trajectories -> rewards -> Samples.

Seed layout (Miles' single-prompt multi-generation): a group's request seeds are spaced so no two
samples of a run share an RNG stream,

    seed_base       = (rollout_seed + group_index * n_samples_per_prompt) % 2**31
    microgroup_seed = seed_base + idx          # idx: the microgroup's first sample, 0, M, 2M, ...

and the engine expands a request's seed into seed, seed+1, ... (one stream per output). group_index
is monotonic over the run. All microgroups of a rollout travel in one HTTP body (the engine denoises
them as one batch); each is still its own request with its own `num_outputs_per_prompt`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from miles_platform.data.sample import Sample
from miles_platform.diffusion.config import NFT_STRATEGIES, STEP_STRATEGIES, DiffusionRunConfig
from miles_platform.plugins import load_function
from miles_platform.tls import client_tls

EVAL_SEED_OFFSET = 1_000_003  # eval noise never collides with a training stream


@dataclass
class Trajectories:
    """What the trainer needs of one rollout, one row per sample (N), K recorded transitions each."""

    prompts: list[str]
    advantages: torch.Tensor  # [N]
    images: torch.Tensor  # [N,C,H,W] final x0 (NFT's target)
    sigma_grid: torch.Tensor  # [S+1]
    latents: torch.Tensor | None = None  # [N,K,C,H,W]
    next_latents: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None  # [N,K]
    sigmas: torch.Tensor | None = None
    next_sigmas: torch.Tensor | None = None
    sigma_max: torch.Tensor | None = None  # [N]
    model_output: torch.Tensor | None = None  # [N,K,C,H,W] with --diffusion-debug-mode

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def step_strategy(cfg: DiffusionRunConfig):
    path = cfg.diffusion_step_strategy_path
    return (
        None
        if not path
        else load_function(STEP_STRATEGIES.get(path, path), "--diffusion-step-strategy-path", 4)
    )


def nft_strategy(cfg: DiffusionRunConfig):
    path = cfg.diffusion_nft_timestep_strategy_path
    return load_function(NFT_STRATEGIES.get(path, path), "--diffusion-nft-timestep-strategy-path", 3)


def reward_function(cfg: DiffusionRunConfig):
    """`--custom-rm-path` (async def rm(args, samples) -> list[float], batched), else `--rm-type`."""
    if cfg.custom_rm_path:
        return load_function(cfg.custom_rm_path, "--custom-rm-path", 2)
    from miles_platform.diffusion.task import attribute_reward

    async def image_attributes(args, samples: list[Sample]) -> list[float]:
        return [attribute_reward(s.prompt, s.metadata["_image"]) for s in samples]

    return image_attributes


class DiffusionRollout:
    """Talks to the engine over loopback HTTP with the run's secret; scores and packs one rollout."""

    def __init__(self, cfg: DiffusionRunConfig, engine_url: str, api_key: str):
        self.cfg, self.url = cfg, engine_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.client = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), verify=client_tls())
        self.strategy = step_strategy(cfg)
        self.rm = reward_function(cfg)

    def close(self) -> None:
        self.client.close()

    def _sampling(self, sde_steps: list[int], ret: list[int] | str, steps: int) -> dict[str, Any]:
        c = self.cfg
        return {"num_inference_steps": steps, "noise_level": c.diffusion_noise_level, "sde_type": c.diffusion_sde_type,
                "sde_steps": sde_steps, "return_steps": ret, "log_prob_no_const": c.diffusion_log_prob_no_const,
                "flow_shift": c.diffusion_flow_shift, "debug_mode": c.diffusion_debug_mode,
                "height": c.diffusion_height, "width": c.diffusion_width}  # fmt: skip

    def _post(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from miles_platform.diffusion.engine import decode_outputs

        r = self.client.post(
            f"{self.url}/rollout/generate", json={"requests": requests}, headers=self.headers
        )
        if r.status_code != 200:
            raise RuntimeError(f"diffusion engine {self.url}: HTTP {r.status_code}: {r.text[:300]}")
        return decode_outputs(r.content)

    def _score(self, samples: list[Sample]) -> list[float]:
        out = self.rm(self.cfg, samples)
        rewards = asyncio.run(out) if asyncio.iscoroutine(out) else out
        if len(rewards) != len(samples):
            raise ValueError(f"reward function returned {len(rewards)} rewards for {len(samples)} samples")
        return [float(r) for r in rewards]

    def generate(self, rollout_id: int, records: list, run: str) -> tuple[list[Sample], Trajectories, dict]:
        """One rollout of `records` (PromptRecords): Samples (for the shard) and the train tensors."""
        from miles_platform.diffusion.losses import grpo_advantages
        from miles_platform.diffusion.task import attribute_checks, to_png

        c, t0 = self.cfg, time.time()
        n, m, steps = c.n_samples_per_prompt, c.rollout_microgroup_size, c.diffusion_num_steps
        if self.strategy is not None:  # one draw per rollout: every group of the rollout shares it
            sde, ret = self.strategy(c, None, steps, c.rollout_seed + rollout_id)
        else:  # NFT: stochastic up to the last step (ode: none); only the final image is trained
            sde, ret = list(range(steps - 1)), []
        if c.rollout_return_full_trajectory:
            ret = "all"
        sampling = self._sampling(list(sde), ret if isinstance(ret, str) else list(ret), steps)
        requests, owner = [], []
        for g, rec in enumerate(records):
            group_index = rollout_id * c.rollout_batch_size + g
            seed_base = (c.rollout_seed + group_index * n) % 2**31
            for idx in range(0, n, m):
                requests.append({"prompt": rec.prompt, "num_outputs_per_prompt": min(m, n - idx),
                                 "seed": seed_base + idx, "sampling_params": sampling})  # fmt: skip
                owner.append((g, group_index, rec))
        outs = self._post(requests)
        t_gen = time.time() - t0
        samples, rows = [], []
        for (_g, group_index, rec), out in zip(owner, outs):
            meta = out["meta_info"]
            for j, seed in enumerate(meta["seeds"]):
                s = Sample(run=run, rollout_id=rollout_id, group_index=group_index, index=len(samples),
                           prompt=rec.prompt, label=rec.label, status="completed",
                           weight_version_start=meta["weight_version_start"],
                           weight_version_end=meta["weight_version_end"],
                           metadata={"_image": out["images"][j], "seed": seed,
                                     "sde_type": c.diffusion_sde_type, "noise_level": c.diffusion_noise_level,
                                     "num_steps": steps})  # fmt: skip
                samples.append(s)
                rows.append((out, j))
        rewards = self._score(samples)
        adv = grpo_advantages(torch.tensor(rewards, dtype=torch.float32), n,
                              std_normalization=not c.disable_grpo_std_normalization,
                              globalize_mean=c.globalize_reward_mean, globalize_std=c.globalize_reward_std)  # fmt: skip
        for s, r, (out, j) in zip(samples, rewards, rows):
            image = s.metadata.pop("_image")
            s.reward = s.raw_reward = r
            s.image_png = to_png(image)
            s.metadata["checks"] = attribute_checks(s.prompt, image) if not c.custom_rm_path else {}
            s.diffusion_steps = [int(i) for i in out["steps"].tolist()]
            s.diffusion_log_probs = out["log_probs"][j].double().tolist() if "log_probs" in out else []
        traj = _stack(rows, [s.prompt for s in samples], adv)
        metrics = {"rollout/raw_reward": sum(rewards) / len(rewards), "perf/rollout_time": time.time() - t0,
                   "perf/generate_time": t_gen, "rollout/advantages_abs_mean": float(adv.abs().mean()),
                   "rollout/zero_std_groups": _zero_std_groups(rewards, n),
                   "rollout/trained_timesteps_per_trajectory": float(len(out["steps"]))}  # fmt: skip
        for key in ("colour_ok", "position_ok"):
            vals = [s.metadata["checks"][key] for s in samples if key in s.metadata.get("checks", {})]
            if vals:
                metrics[f"rollout/reward/{key}_mean"] = sum(vals) / len(vals)
        return samples, traj, metrics

    def evaluate(
        self, name: str, records: list
    ) -> tuple[dict[str, float], list[tuple[str, torch.Tensor, float]]]:
        """Held-out reward with deterministic (ODE) sampling and fixed seeds: comparable across versions.
        Returns the metrics and (prompt, image, reward) per sample."""
        c = self.cfg
        steps = c.diffusion_eval_num_steps or c.diffusion_num_steps
        sampling = self._sampling([], [], steps)
        reqs = [{"prompt": r.prompt, "num_outputs_per_prompt": c.n_samples_per_eval_prompt,
                 "seed": EVAL_SEED_OFFSET + i * c.n_samples_per_eval_prompt, "sampling_params": sampling}
                for i, r in enumerate(records)]  # fmt: skip
        outs = self._post(reqs)
        samples = [Sample(prompt=r.prompt, label=r.label, metadata={"_image": img})
                   for r, o in zip(records, outs) for img in o["images"]]  # fmt: skip
        rewards = self._score(samples)
        shown = [(s.prompt, s.metadata["_image"], rw) for s, rw in zip(samples, rewards)]
        return {f"eval/{name}/mean_reward": sum(rewards) / len(rewards)}, shown


def _zero_std_groups(rewards: list[float], n: int) -> float:
    groups = [rewards[i : i + n] for i in range(0, len(rewards), n)]
    return float(sum(1 for g in groups if max(g) - min(g) < 1e-9))


def _stack(rows: list[tuple[dict, int]], prompts: list[str], adv: torch.Tensor) -> Trajectories:
    def cat(key: str):
        if key not in rows[0][0]:
            return None
        return torch.stack([out[key][j] for out, j in rows])

    return Trajectories(prompts=prompts, advantages=adv, images=cat("images"), sigma_grid=rows[0][0]["sigma_grid"],
                        latents=cat("latents"), next_latents=cat("next_latents"), log_probs=cat("log_probs"),
                        sigmas=cat("sigmas"), next_sigmas=cat("next_sigmas"), sigma_max=cat("sigma_max"),
                        model_output=cat("model_output"))  # fmt: skip
