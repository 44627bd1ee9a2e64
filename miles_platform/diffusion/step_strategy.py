"""Which denoising transitions are stochastic and trained: Miles' step-strategy hooks.

`--diffusion-step-strategy-path` (Flow-GRPO): `(args, sample, num_steps, seed) -> (sde_steps,
return_steps)`. Transition i goes from sigma_i to sigma_{i+1}; transition num_steps - 1 lands on
sigma = 0. `sde_steps` use the stochastic step, every other transition is an ODE step (`OdeStepBackend`:
Flow-SDE at eta = 0 has no density);
`return_steps` are the transitions the engine records for training (here: the SDE steps).
(Miles' engine returns latent indices S | S+1 instead; ours records transitions directly.)

`--diffusion-nft-timestep-strategy-path` (DiffusionNFT): `(args, num_steps, generator) -> steps`,
the sigma indices each sample trains on, in training order; the final clean output (sigma = 0,
index num_steps) is never one.

`args` is any object with the flags as attributes (a DiffusionRunConfig, a Namespace).
Reference: Miles `miles/rollout/step_strategy_hub.py` and `miles/ray/data_conversion_hub/nft.py`
(radixark/miles_diffusion), re-implemented.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from miles_platform.errors import ConfigError

NUM_SDE_FLAG = "--diffusion-num-sde-steps"
WINDOW_FLAG = "--diffusion-sde-window-range"
CANDIDATES_FLAG = "--diffusion-sde-candidate-steps"
NFT_DROP_FLAG = "--diffusion-nft-num-dropped-timesteps"


def _int_list(raw: str | Sequence[int], flag: str) -> list[int]:
    try:
        if isinstance(raw, str):
            return [int(x) for x in raw.split(",") if x.strip()]
        return [int(x) for x in raw]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{flag} {raw!r}: expected comma-separated integers, e.g. '1,2,3'") from e


def _window_range(args: Any, num_steps: int) -> tuple[int, int]:
    raw = getattr(args, "diffusion_sde_window_range", None)
    if raw is None or raw == "":
        # Default leaves out the final transition into sigma = 0: CPS has no density there and
        # flow_grpo never trains it (timestep_fraction < 1). Pass 0,N to include it for Flow-SDE.
        return 0, num_steps - 1
    parts = _int_list(raw, WINDOW_FLAG)
    if len(parts) != 2:
        raise ConfigError(f"{WINDOW_FLAG} {raw!r}: expected 'lo,hi'")
    lo, hi = parts
    if not 0 <= lo < hi <= num_steps:
        raise ConfigError(
            f"{WINDOW_FLAG} {lo},{hi}: must satisfy 0 <= lo < hi <= {num_steps} (--diffusion-num-steps)"
        )
    return lo, hi


def sde_window(args: Any, sample: Any, num_steps: int, seed: int) -> tuple[list[int], list[int]]:
    """A contiguous window of `--diffusion-num-sde-steps` transitions inside
    `--diffusion-sde-window-range` [lo, hi) (default [0, num_steps - 1)); its start is drawn from
    `seed`, so one seed always gives one window."""
    del sample  # the window depends on the seed only
    size = int(getattr(args, "diffusion_num_sde_steps", 0) or 0)
    lo, hi = _window_range(args, num_steps)
    if not 1 <= size <= hi - lo:
        raise ConfigError(
            f"{NUM_SDE_FLAG} {size}: must be in [1, {hi - lo}], the width of the window range [{lo}, {hi})"
            + ("" if getattr(args, "diffusion_sde_window_range", None) else f" (default; set {WINDOW_FLAG})")
        )
    start = random.Random(seed).randint(lo, hi - size)
    steps = list(range(start, start + size))
    return steps, list(steps)


def epoch_global_random_choice(
    args: Any, sample: Any, num_steps: int, seed: int
) -> tuple[list[int], list[int]]:
    """`--diffusion-num-sde-steps` of `--diffusion-sde-candidate-steps`, ascending, drawn from
    `seed`: every sample given the same seed gets the same subset (Miles shares one per block of
    --rollout-batch-size prompt groups, so the caller passes one seed per rollout, e.g.
    rollout_seed + rollout_id). 0 (or more than there are candidates) selects every candidate."""
    del sample
    raw = getattr(args, "diffusion_sde_candidate_steps", None)
    if raw is None or raw == "" or raw == []:
        raise ConfigError(
            f"epoch_global_random_choice needs {CANDIDATES_FLAG} (e.g. '1,2,3'); valid indices depend on "
            "the sigma schedule, so there is no default"
        )
    candidates = list(dict.fromkeys(_int_list(raw, CANDIDATES_FLAG)))
    bad = [c for c in candidates if not 0 <= c < num_steps]
    if bad:
        raise ConfigError(
            f"{CANDIDATES_FLAG} {bad}: out of range for a {num_steps}-step schedule [0, {num_steps})"
        )
    k = int(getattr(args, "diffusion_num_sde_steps", 0) or 0)
    steps = (
        sorted(candidates)
        if k <= 0 or k >= len(candidates)
        else sorted(random.Random(seed).sample(candidates, k))
    )
    return steps, list(steps)


def _num_dropped(args: Any, num_steps: int) -> int:
    k = int(getattr(args, "diffusion_nft_num_dropped_timesteps", 0) or 0)
    if not 0 <= k < num_steps:
        raise ConfigError(f"{NFT_DROP_FLAG} {k}: must be in [0, {num_steps}) so at least one step is trained")
    return k


def drop_random_steps(args: Any, num_steps: int, generator: torch.Generator) -> list[int]:
    """All sampling steps but `--diffusion-nft-num-dropped-timesteps` random ones, in random order
    (a permutation drawn from the per-sample `generator`)."""
    k = _num_dropped(args, num_steps)
    return torch.randperm(num_steps, generator=generator)[: num_steps - k].tolist()


def drop_final_steps(args: Any, num_steps: int, generator: torch.Generator) -> list[int]:
    """All sampling steps but the final (lowest-noise) `--diffusion-nft-num-dropped-timesteps`, in
    schedule order, noisiest first. Deterministic: `generator` is unused."""
    del generator
    return list(range(num_steps - _num_dropped(args, num_steps)))
