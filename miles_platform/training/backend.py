"""Trainer backend contract: what the Ray trainer actor needs from a model implementation.

The actor (training/actor.py) owns everything backend-independent: micro-batching, the
loss hub, the optimizer and LR schedule, checkpoint bookkeeping (iter_NNNNNNN +
latest_checkpointed_iteration.txt), weight export to engines. A backend owns the model:
how it is built, how it computes logits, how its weights map to canonical HF names, and
how its weights are written to / read from a checkpoint directory.

Backends: `fsdp` (torch-native HF model; FSDP2 over gloo/NCCL when world_size > 1) and
`megatron` (megatron-core GPTModel; local spec on CPU, TE spec on GPU).

`device`: the rank's device (cluster/devices.py). A backend builds its model on the CPU (the same
initial values whatever the device: LoRA's random init, loaded weights), then moves it there; the
inputs `logits` gets are already on it.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from miles_platform.config import RunConfig
from miles_platform.training.shared_prefix import PackedRows


@dataclass
class ScoreRequest:
    """One micro-batch forward and what to score from it (positions 0..T-2 score tokens 1..T-1).

    `support` [B, T-1, K]: sampling-support replay ids (-1 padding); `candidates` [B, T-1, K]: ids
    whose log-probs a loss reads (score centering); `context`: entered around the model forward
    (MoE routing replay, aux-loss collection)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    temperature: float = 1.0
    support: torch.Tensor | None = None
    with_entropy: bool = False
    candidates: torch.Tensor | None = None
    context: Callable[[], Any] = field(default=contextlib.nullcontext)
    # False: the entropy is only observed (a metric), computed outside autograd (Miles' rule: it takes
    # gradients only at a non-zero --entropy-coef)
    entropy_grad: bool = True
    # vision-language samples: per row its images as data URIs (None: text) and its unpadded length
    images: list[list[str] | None] | None = None
    lengths: list[int] | None = None
    # the same rows packed by shared prompt (training/shared_prefix.py), where the backend takes it
    packed: PackedRows | None = None


class Scores(NamedTuple):
    """[B, T-1] log-probs of the next tokens, their entropies (or None), [B, T-1, K] candidates."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


def scores_from_logits(logits: torch.Tensor, req: ScoreRequest, following: bool = False) -> Scores:
    """Scores from full-vocabulary logits [B, T, V] (the loss hub's token / candidate log-probs).
    `following`: every position of `logits` is scored, `req.input_ids` holding the token after each
    (context parallelism scores a rank's positions so)."""
    from miles_platform.training import loss as loss_hub

    z, targets = (logits, req.input_ids) if following else (logits[:, :-1], req.input_ids[:, 1:])
    lp, ent = loss_hub.token_log_probs(
        z, targets, req.temperature, req.support, req.with_entropy, req.entropy_grad
    )
    cand = None
    if req.candidates is not None:
        cand = loss_hub.candidate_log_probs(z, req.candidates, req.temperature, req.support)
    return Scores(lp, ent, cand)


def all_reduce_grads(params, group=None, mean_over: int | None = None) -> None:
    """Sum the gradients of `params` over `group` (the world when None), or average them with `mean_over`
    ranks: one collective per dtype on a flat buffer, not one per tensor. A parameter without a gradient
    contributes zeros; each gradient keeps its tensor (the result is copied into it)."""
    import torch.distributed as dist

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if mean_over:
            flat /= mean_over
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))


class ModelBackend(ABC):
    name: str = ""
    # its `packed_logits` computes shared-prefix packed rows (set by `build` for the model it built)
    shares_prefixes: bool = False

    def __init__(
        self, cfg: RunConfig, rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu"
    ):
        from miles_platform.cluster.devices import config_on_device

        self.device = torch.device(device)
        self.cfg, self.rank, self.world_size = config_on_device(cfg, self.device), rank, world_size

    @abstractmethod
    def build(self, hf_checkpoint: str, trainable: bool = True) -> torch.nn.Module:
        """Build the model initialised from an HF checkpoint dir; return the module.
        `trainable=False` (the frozen reference): no gradient machinery is set up."""

    @abstractmethod
    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids (right-padded, on `self.device`) -> [B, T, V] fp32-castable logits, causal."""

    @abstractmethod
    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights under canonical HF names, on CPU: what engines load."""

    @abstractmethod
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full weights given under canonical HF names."""

    @abstractmethod
    def save_model(self, ckpt_dir: str) -> None:
        """Write model weights into an iter_NNNNNNN dir (fsdp: safetensors; megatron: torch_dist)."""

    @abstractmethod
    def load_model(self, ckpt_dir: str) -> None:
        """Read model weights written by save_model."""

    def zero_grad(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Before a step's first backward, after the optimizer's zero_grad: clear any gradient
        state the backend keeps outside `.grad`."""

    def finish_grad_sync(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """After a step's last backward, before clipping: leave on each parameter's `.grad` the
        average over data-parallel ranks. FSDP2 reduce-scatters inside backward: nothing to do."""

    # ---- the train step's micro-batches (megatron: its pipeline schedule) ----
    def packed_logits(self, packed: PackedRows) -> torch.Tensor:
        """[G, L] shared-prefix packed rows -> [G, L, V] logits under their mask (shares_prefixes)."""
        raise NotImplementedError(f"--train-backend {self.name} does not compute packed rows")

    def score(self, req: ScoreRequest) -> Scores:
        """One micro-batch forward and its scores (of its packed rows when it has them)."""
        with req.context():
            if req.packed is not None:
                logits = req.packed.unpack(self.packed_logits(req.packed))
            else:
                logits = self.logits(req.input_ids, req.position_ids)
        return scores_from_logits(logits, req)

    def run_micro_batches(
        self,
        reqs: list[ScoreRequest],
        consume: Callable[[int, Scores], torch.Tensor | None],
        forward_only: bool = False,
    ) -> None:
        """Forward each request; `consume(k, scores)` gives micro-batch k's loss (already weighted
        for the global batch), which is backpropagated unless `forward_only` (then it may be None).
        Under pipeline parallelism `consume` runs on the last stage only."""
        for k, req in enumerate(reqs):
            loss = consume(k, self.score(req))
            if not forward_only:
                loss.backward()

    def from_last_stage(self, obj: Any) -> Any:
        """`obj` as the last pipeline stage computed it (what `consume` produced), on every rank."""
        return obj

    def writes_sample_rows(self) -> bool:
        """This rank writes the train_samples rows of its samples (training/train_samples.py): one
        rank of each data-parallel group (model-parallel peers hold the same samples)."""
        return True

    def data_parallel(self) -> tuple[int, int, Any]:
        """(rank, size, process group) of this rank's data-parallel group: ranks that take
        different samples. Without model parallelism every rank is one (group None = world)."""
        return self.rank, self.world_size, None

    def build_optimizer(self) -> Any:
        """The optimizer this backend steps its own way (megatron's distributed optimizer: an object
        with torch.optim's param_groups / state / zero_grad / step), or None: the actor's torch one."""
        return None

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip `.grad` to a global L2 norm of max_norm; returns the norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.parameters() if p.grad is not None], max_norm
        )
        return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm

    # a checkpoint of this backend loads under another layout (world size): model and optimizer
    reshards_checkpoints = False

    def save_optimizer(self, opt: torch.optim.Optimizer, ckpt_dir: str) -> bool:
        """Write the optimizer state into ckpt_dir if this backend keeps it its own way (True);
        False: the actor writes its per-rank files."""
        return False

    def load_optimizer(self, opt: torch.optim.Optimizer, ckpt_dir: str) -> bool:
        """Read what save_optimizer wrote (True), or False: the actor reads its per-rank files."""
        return False

    def async_checkpoint(self, opt: torch.optim.Optimizer | None) -> Any:
        """--async-save of a backend that writes its checkpoint its own way: an object with
        `prepare(dir)`, `write(dir)`, `finalize(dir)` (Checkpointer.save_async's phases) for the
        model and `opt` (None: not saved); None: `snapshot_model` and the actor's per-rank files."""
        return None

    def loss_scale_metrics(self) -> dict[str, float]:
        """After clip_grad_norm, a backend that scales the loss (megatron --fp16): the scale after
        this step's update (`train/loss_scale`) and whether the gradients overflowed at the scale
        (`train/loss_scale_skipped_steps`: the step is skipped, as megatron's, and is not a non-finite
        step); {} for one that does not."""
        return {}

    def optimizer_stepped(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """After the optimizer stepped `parameters()`: bring the model up to date with them (a
        backend whose optimizer steps copies of the weights, e.g. fp32 main parameters)."""

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()
