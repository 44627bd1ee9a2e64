"""Mixture-of-experts models (docs/moe.md): rollout routing replay (R3) and Miles' --moe-* flags
that mean something for HF's MoE blocks at expert parallel 1. Preflight checks the checkpoint is MoE."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import NON_NEGATIVE, changed_flags, flag
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = dict.fromkeys(("moe_aux_loss_coeff", "moe_z_loss_coeff"), NON_NEGATIVE)


@dataclass
class MoeFlags:
    use_rollout_routing_replay: bool = flag(
        False, "algorithm",
        "R3 (MoE): the engine returns each token's top-k experts, the trainer replays them in every forward",
    )  # fmt: skip
    # MoE (docs/moe.md): Miles' --moe-* flags that mean something for HF's MoE blocks at EP=1
    moe_aux_loss_coeff: float = flag(
        0.0,
        "algorithm",
        "MoE: coefficient of the load-balancing loss (Switch / megatron's aux_loss) added to the policy loss",
    )
    moe_z_loss_coeff: float = flag(
        0.0,
        "algorithm",
        "MoE: coefficient of the router z-loss (megatron's: mean logsumexp(router logits)^2)",
    )
    moe_router_freeze_gate: bool = flag(False, "algorithm", "MoE: the routers' weights are not trained")
    moe_router_dtype: str | None = flag(
        None, "algorithm", "MoE: routers compute in fp32 (input and weight cast) under any forward dtype, trainer and engine",
        choices=("fp32",),
    )  # fmt: skip

    def moe_flags(self) -> list[str]:
        """The --moe-* flags set (they need an MoE --hf-checkpoint: preflight checks it)."""
        return changed_flags(
            self, ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_freeze_gate", "moe_router_dtype")
        )

    def _check_routing_replay(self) -> None:
        """R3 (docs/moe.md): what can be checked without the checkpoint; preflight checks it is MoE."""
        if not self.use_rollout_routing_replay:
            return
        why = None
        if self.use_rollout_logprobs or self.uses_lora:
            why = "--use-rollout-logprobs / LoRA with routing replay is not built"
        if why:
            raise ConfigError(f"--use-rollout-routing-replay: {why}")

    def _check_moe_flags(self) -> None:
        """--moe-router-dtype fp32 holds under any forward dtype (megatron-core's moe_router_dtype: the
        gates cast their bf16 / fp16 input and weight to fp32; models/moe.py route_in_fp32 does the
        same for HF's routers in the fsdp trainer and the embedded engine). Other values (Miles'
        fp64) are refused by --moe-router-dtype's choices."""
