"""The policy trainer's weights on their way to the engines (`TrainerActor`'s methods, here to keep
training/actor.py readable): HF-named exports, LoRA adapters, shared-memory staging for --colocate,
the broadcast transport's group and bucket stream, each quantized as a quantized --hf-checkpoint is
(weights/rollout_quant.py)."""

from __future__ import annotations

import torch


class ActorWeights:
    """Mixed into TrainerActor: uses its cfg, rank, device, backend, hooks and _weight_groups."""

    def stage_weights(self) -> dict:
        """The policy under HF names in shared memory for the engine on this rank's device
        (`--colocate`, weights/shared_tensors.py): the descriptor its /update_weights_from_tensor
        takes. Collective under FSDP (every rank exports); held until `unstage_weights`."""
        from miles_platform.weights.shared_tensors import stage

        self.unstage_weights()
        self.hooks.fire("trainer_weight_update_before_all_gather")
        self._staged = stage(self._for_engines(self.backend.export_hf_state_dict()))
        self.hooks.fire("trainer_weight_update_before_send")
        return self._staged.descriptor

    def _for_engines(self, state: dict[str, torch.Tensor], partial: bool = False) -> dict[str, torch.Tensor]:
        """What the engines get of `state`: quantized as a quantized --hf-checkpoint is (fp8 / int4,
        weights/rollout_quant.py; `partial`: one bucket of the model), else `state` itself."""
        from miles_platform.weights.rollout_quant import rollout_quant

        rq = rollout_quant(self.cfg.hf_checkpoint)
        return rq.quantize(state, partial=partial) if rq is not None else state

    def unstage_weights(self) -> None:
        staged, self._staged = getattr(self, "_staged", None), None
        if staged is not None:
            staged.close()

    def get_hf_weights(self) -> dict[str, torch.Tensor]:
        """The policy under HF names (a LoRA trainer's merged weights: for exports on demand)."""
        self.hooks.fire("trainer_weight_update_before_all_gather")
        return self.backend.export_hf_state_dict()

    def get_lora_adapter(self) -> tuple[dict[str, torch.Tensor], dict]:
        """--lora-rank > 0: (lora_A / lora_B tensors, adapter_config.json), what a weight update ships."""
        self.hooks.fire("trainer_weight_update_before_all_gather")
        return self.backend.export_adapter()

    def get_base_weights(self) -> dict[str, torch.Tensor]:
        """--lora-rank > 0: the frozen base under HF names (the engines' base, for the weight check)."""
        return self.backend.export_base_state_dict()

    # broadcast transport: rank 0 is rank 0 of a standalone group with the engines
    def weights_update_endpoint(self) -> dict:
        from miles_platform.weights.transports.broadcast import weights_update_endpoint

        return weights_update_endpoint()

    def init_weights_update_group(
        self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Rank 0 only: host the group's store and join as rank 0 (blocks until the engines join)."""
        from miles_platform.weights.transports.broadcast import new_weights_group

        self._weight_groups[group_name] = (
            new_weights_group(master_address, master_port, 0, world_size, group_name, backend),
            backend,
        )

    def broadcast_weights(self, group_name: str, names: list[str] | None = None) -> dict:
        """Gather the HF weights bucket by bucket (collective: every rank calls this; megatron:
        `--update-weight-buffer-size` buckets, fsdp: one), while rank 0 broadcasts each tensor in
        `names` order (default: export order) as soon as its bucket is in. Returns the metadata."""
        from miles_platform.weights.transports.broadcast import broadcast_buckets

        self.hooks.fire("trainer_weight_update_before_all_gather")
        buckets = getattr(self.backend, "hf_buckets", None)
        stream = buckets() if buckets is not None else iter([self.backend.export_hf_state_dict()])
        stream = (self._for_engines(b, partial=buckets is not None) for b in stream)
        if self.rank != 0:
            for _ in stream:  # the collectives of every bucket
                pass
            return {}
        group, backend = self._weight_groups[group_name]
        # NCCL sends from this rank's GPU; the hook fires in the sending rank before its first send
        device = self.device if backend == "nccl" else "cpu"
        first = lambda: self.hooks.fire("trainer_weight_update_before_send")  # noqa: E731
        return broadcast_buckets(group, device, stream, names, first)
