"""SDE step backends: one transition x_sigma -> x_next_sigma of a flow-matching sampler.

The engine calls `step` (draw the transition, record its log-prob); the Flow-GRPO trainer calls
`sde_step_logprob` (re-score the recorded transition under its own velocity). Both run the same
`prev_mean_and_std` and `log_prob` on the same dtype, so with equal inputs the trainer reproduces
the engine's log-prob bit for bit and the PPO ratio starts at exactly 1.

Convention (SD3 flow matching): x_sigma = (1 - sigma) x0 + sigma eps, the model predicts
v = eps - x0, dt = next_sigma - sigma < 0. `sigma`, `next_sigma`, `sigma_max` are per-sample [B]
tensors (or python floats) recorded by the engine; `sigma_max` is the schedule's second sigma,
substituted for sigma in the Flow-SDE std where sigma == 1 (1/(1 - sigma) is singular there).
Log-probs are per transition, averaged over the non-batch dims (flow_grpo), shape [B].

Compute dtype: float32, or float64 when sample or model_output is float64 (bf16/fp16 inputs are
upcast, as flow_grpo does: bf16 overflows in the mean). `step` returns prev_sample in the sample's
dtype and scores exactly that rounded tensor, so the trainer scoring the stored latent agrees.

Formulas: flow_grpo `flow_grpo/diffusers_patch/sd3_sde_with_logprob.py` (yifan123/flow_grpo) and
Miles `miles/backends/fsdp_utils/sde_step_backend.py` (radixark/miles_diffusion), re-implemented.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from miles_platform.errors import ConfigError
from miles_platform.plugins import load_object

Scalar = torch.Tensor | float
SDE_TYPE_FLAG = "--diffusion-sde-type"
BACKEND_PATH_FLAG = "--sde-step-backend-path"
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass(frozen=True)
class StepOut:
    """One scored transition. prev_mean / std / std_dev_t are in the compute dtype."""

    prev_sample: torch.Tensor  # [B, ...] the transition's end point (step: in the sample's dtype)
    log_prob: torch.Tensor  # [B] mean over non-batch dims of the per-element log-density
    prev_mean: torch.Tensor  # [B, ...] the transition mean (differentiable w.r.t. model_output)
    std: torch.Tensor  # [B, 1, ...] the Gaussian std of the transition (what log_prob scores against)
    std_dev_t: torch.Tensor  # [B, 1, ...] the diffusion scale flow_grpo divides its KL by (see kl_to_ref)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or float64 if any input is float64 (never bf16/fp16)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _per_sample(x: Scalar, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B] tensor or float -> [B, 1, ..., 1] broadcastable against `like`."""
    t = torch.as_tensor(x, dtype=dtype, device=like.device)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def _mean_over_non_batch(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


class SdeStepBackend:
    """Base: subclasses define `prev_mean_and_std` (and, for other densities, `log_prob`).

    A custom backend for `--sde-step-backend-path pkg.module.ClassName` subclasses this; it is built
    as `ClassName(log_prob_no_const=...)`, which the inherited `__init__` accepts.
    """

    name: str = "custom"
    deterministic: bool = False  # no density: Flow-GRPO cannot train on it (NFT can)

    def __init__(self, log_prob_no_const: bool = False) -> None:
        self.log_prob_no_const = log_prob_no_const

    # -- the one kernel both sides share ---------------------------------------------------------
    def prev_mean_and_std(
        self,
        sample: torch.Tensor,
        model_output: torch.Tensor,
        sigma: torch.Tensor,
        next_sigma: torch.Tensor,
        sigma_max: torch.Tensor,
        noise_level: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prev_mean, std, std_dev_t); sigmas arrive as [B, 1, ...] in the compute dtype."""
        raise NotImplementedError

    def log_prob(
        self, prev_sample: torch.Tensor, prev_mean: torch.Tensor, std: torch.Tensor, no_const: bool = False
    ) -> torch.Tensor:
        """Gaussian log N(prev | mean, std^2), mean over non-batch dims. Without constants
        (`no_const`) it keeps only -(x - mu)^2 / (2 std^2): -log std depends on sigma alone, so the
        PPO ratio is the same either way."""
        lp = -((prev_sample - prev_mean) ** 2) / (2 * std**2)
        if not no_const:
            lp = lp - torch.log(std) - _LOG_SQRT_2PI
        return _mean_over_non_batch(lp)

    def is_trainable(self, step_index: int, num_steps: int) -> bool:
        """Whether transition `step_index` (of `num_steps`, the last one landing on sigma = 0) has a
        proper density a Flow-GRPO loss can train on."""
        return not self.deterministic and 0 <= step_index < num_steps

    # -- engine side -------------------------------------------------------------------------
    def step(
        self,
        sample: torch.Tensor,
        model_output: torch.Tensor,
        sigma: Scalar,
        next_sigma: Scalar,
        sigma_max: Scalar,
        noise_level: Scalar,
        *,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        log_prob_no_const: bool | None = None,
    ) -> StepOut:
        """Draw prev_sample = mean + std * noise and return its log-prob.

        Pass `noise` (standard normal, shape of sample) or a `generator` (on sample's device; the
        noise is drawn in the compute dtype), not both; with neither, torch's global RNG draws it.
        A deterministic backend (ode) draws nothing. `log_prob_no_const` overrides the backend's
        setting for this call (None: keep it; cps / ode always drop the constants).
        """
        if noise is not None and generator is not None:
            raise ValueError("step(): pass noise or generator, not both")
        dtype = compute_dtype(sample, model_output)
        mean, std, std_dev_t = self._kernel(sample, model_output, sigma, next_sigma, sigma_max, noise_level)
        if self.deterministic:
            prev_sample = mean.to(sample.dtype)
        else:
            if noise is None:
                noise = torch.randn(sample.shape, generator=generator, device=sample.device, dtype=dtype)
            # Round to the latent's storage dtype first and score that, so the trainer (which sees
            # the stored latent) reproduces this log-prob exactly.
            prev_sample = (mean + std * noise.to(dtype)).to(sample.dtype)
        log_prob = self.log_prob(prev_sample.to(dtype), mean, std, self._no_const(log_prob_no_const))
        return StepOut(prev_sample, log_prob, mean, std, std_dev_t)

    # -- trainer side ------------------------------------------------------------------------
    def sde_step_logprob(
        self,
        sample: torch.Tensor,
        model_output: torch.Tensor,
        sigma: Scalar,
        next_sigma: Scalar,
        sigma_max: Scalar,
        noise_level: Scalar,
        prev_sample: torch.Tensor,
        *,
        log_prob_no_const: bool | None = None,
    ) -> StepOut:
        """Log-prob of the recorded prev_sample under `model_output` (differentiable w.r.t. it)."""
        dtype = compute_dtype(sample, model_output)
        mean, std, std_dev_t = self._kernel(sample, model_output, sigma, next_sigma, sigma_max, noise_level)
        prev = prev_sample.detach().to(dtype)
        log_prob = self.log_prob(prev, mean, std, self._no_const(log_prob_no_const))
        return StepOut(prev, log_prob, mean, std, std_dev_t)

    def _no_const(self, override: bool | None) -> bool:
        return self.log_prob_no_const if override is None else override

    def _kernel(
        self,
        sample: torch.Tensor,
        model_output: torch.Tensor,
        sigma: Scalar,
        next_sigma: Scalar,
        sigma_max: Scalar,
        noise_level: Scalar,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.deterministic and isinstance(noise_level, int | float) and noise_level <= 0:
            # std = 0: no density (Flow-SDE would give NaN); eta = 0 is the ode step
            raise ConfigError(
                f"--diffusion-noise-level {noise_level}: must be > 0 for {SDE_TYPE_FLAG} {self.name} "
                f"(use {SDE_TYPE_FLAG} ode for deterministic steps)"
            )
        dtype = compute_dtype(sample, model_output)
        s, s_next, s_max, eta = (
            _per_sample(v, sample, dtype) for v in (sigma, next_sigma, sigma_max, noise_level)
        )
        return self.prev_mean_and_std(sample.to(dtype), model_output.to(dtype), s, s_next, s_max, eta)


class FlowSdeStepBackend(SdeStepBackend):
    """Flow-GRPO's SDE (`--diffusion-sde-type sde`).

    std_dev_t = eta * sqrt(sigma / (1 - sigma')), sigma' = sigma_max where sigma == 1 else sigma
    mean      = x (1 + std_dev_t^2 dt / (2 sigma)) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt
    std       = std_dev_t * sqrt(-dt)
    The last step (next_sigma = 0) is a proper Gaussian (std = std_dev_t * sqrt(sigma)); only
    sigma > 0 and eta > 0 are needed.
    """

    name = "sde"

    def prev_mean_and_std(self, sample, model_output, sigma, next_sigma, sigma_max, noise_level):
        dt = next_sigma - sigma
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        mean = (
            sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        return mean, std_dev_t * torch.sqrt(-dt), std_dev_t


class CpsSdeStepBackend(SdeStepBackend):
    """FlowCPS (`--diffusion-sde-type cps`): log-prob -(x - mu)^2, no constants, no 1/(2 std^2).

    std   = next_sigma * sin(eta * pi / 2)
    x0    = x - sigma v,  eps = x + (1 - sigma) v
    mean  = x0 (1 - next_sigma) + eps * sqrt(next_sigma^2 - std^2)
    At the last step (next_sigma = 0) std = 0: the step is deterministic (prev = mean = x0) and its
    "log-prob" -(x - mu)^2 is finite but no density, so `is_trainable` is False there; step
    strategies keep it out of training by default.
    """

    name = "cps"

    def __init__(self, log_prob_no_const: bool = True) -> None:
        super().__init__(log_prob_no_const=True)  # forced, as in Miles: the only form CPS has

    def prev_mean_and_std(self, sample, model_output, sigma, next_sigma, sigma_max, noise_level):
        std = next_sigma * torch.sin(noise_level * (math.pi / 2))
        x0_hat = sample - sigma * model_output
        eps_hat = sample + (1 - sigma) * model_output
        # clamp: rounding can push next^2 - std^2 a hair below 0 at eta = 1
        mean = x0_hat * (1 - next_sigma) + eps_hat * torch.sqrt(torch.clamp(next_sigma**2 - std**2, min=0))
        return mean, std, std

    def log_prob(self, prev_sample, prev_mean, std, no_const=True):
        return _mean_over_non_batch(-((prev_sample - prev_mean) ** 2))  # never has constants

    def is_trainable(self, step_index: int, num_steps: int) -> bool:
        return 0 <= step_index < num_steps - 1


class OdeStepBackend(FlowSdeStepBackend):
    """Deterministic Euler (`--diffusion-sde-type ode`): prev = x + dt * v, log_prob = 0.

    The Flow-SDE mean at eta = 0 (plain Euler). Only NFT samples with it; re-scoring an
    ODE transition (`sde_step_logprob`) is refused: it has no density for Flow-GRPO to train on.
    """

    name = "ode"
    deterministic = True

    def __init__(self, log_prob_no_const: bool = True) -> None:
        super().__init__(log_prob_no_const=True)

    def prev_mean_and_std(self, sample, model_output, sigma, next_sigma, sigma_max, noise_level):
        mean = sample + (next_sigma - sigma) * model_output
        zero = torch.zeros_like(sigma)
        return mean, zero, zero

    def log_prob(self, prev_sample, prev_mean, std, no_const=True):
        return prev_sample.new_zeros(prev_sample.shape[0])

    def sde_step_logprob(self, *args, **kwargs) -> StepOut:
        raise ConfigError(
            f"{SDE_TYPE_FLAG} ode: deterministic transitions have no log-prob; Flow-GRPO "
            f"(--loss-type policy_loss) needs {SDE_TYPE_FLAG} sde or cps (ode is for --loss-type nft)"
        )


BACKENDS: dict[str, type[SdeStepBackend]] = {
    "sde": FlowSdeStepBackend,
    "cps": CpsSdeStepBackend,
    "ode": OdeStepBackend,
}


def backend_for(sde_type: str, path: str | None = None, *, log_prob_no_const: bool = False) -> SdeStepBackend:
    """The backend for `--diffusion-sde-type` (sde / cps / ode), or the `SdeStepBackend` subclass at
    `--sde-step-backend-path pkg.module.ClassName` when given (then sde_type is not checked, as in
    Miles). `log_prob_no_const` is `--diffusion-log-prob-no-const` (cps / ode force it on)."""
    if path:
        cls = load_object(path, BACKEND_PATH_FLAG)
        if not (isinstance(cls, type) and issubclass(cls, SdeStepBackend)):
            raise ConfigError(
                f"{BACKEND_PATH_FLAG} {path!r}: {cls!r} is not a subclass of "
                "miles_platform.diffusion.sde.SdeStepBackend"
            )
        try:
            return cls(log_prob_no_const=log_prob_no_const)
        except TypeError as e:
            raise ConfigError(
                f"{BACKEND_PATH_FLAG} {path!r}: cannot construct {cls.__name__}(log_prob_no_const=...): {e}"
            ) from e
    if sde_type not in BACKENDS:
        raise ConfigError(f"{SDE_TYPE_FLAG} {sde_type!r}: must be one of {', '.join(BACKENDS)}")
    return BACKENDS[sde_type](log_prob_no_const=log_prob_no_const)
