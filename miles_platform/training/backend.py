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

from abc import ABC, abstractmethod

import torch

from miles_platform.config import RunConfig


class ModelBackend(ABC):
    name: str = ""

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

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()
