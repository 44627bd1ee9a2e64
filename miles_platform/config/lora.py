"""LoRA (docs/lora.md): PEFT adapters trained on the fsdp or megatron backend and synced to the engines through
SGLang's LoRA API, under Miles' flag names and defaults. Target names are resolved against the model
at start (training/lora.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from miles_platform.config.flags import NON_NEGATIVE, changed_flags, flag
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = {
    "lora_rank": NON_NEGATIVE,
    "lora_alpha": (0, None, True, "> 0"),
    "lora_dropout": (0, 1, False, "in [0, 1)"),
}

# every LoRA flag but the rank: set while --lora-rank is 0 they are an error
LORA_FLAGS = ("lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "lora_adapter_path",
              "lora_train_only", "check_lora_weight_equal")  # fmt: skip


@dataclass
class LoraFlags:
    lora_rank: int = flag(0, "lora", "adapter rank; 0 = off (full fine-tuning), > 0 trains a LoRA adapter")
    lora_alpha: int = flag(16, "lora", "adapter scaling factor (scale = alpha / rank)")
    lora_dropout: float = flag(0.0, "lora", "dropout on the adapter path (RL normally uses 0)")
    target_modules: str | None = flag(
        None,
        "lora",
        "comma-separated: all-linear (alone), groups attn / mlp / unembed, HF leaf names (q_proj) or "
        "scoped HF paths (model.layers.0.self_attn.q_proj), globs allowed; default attention + MLP",
    )
    exclude_modules: str | None = flag(
        None, "lora", "comma-separated HF leaf names or scoped paths removed after --target-modules"
    )
    lora_adapter_path: str | None = flag(
        None, "lora", "start from this PEFT adapter dir (its rank, alpha and targets must match the flags)"
    )
    lora_train_only: bool = flag(
        False, "lora", "train the adapter, keep the rollout engines on the frozen base (no adapter sync)"
    )
    check_lora_weight_equal: bool = flag(
        False, "lora", "after every adapter sync verify each engine-side adapter tensor by SHA-256"
    )

    @property
    def uses_lora(self) -> bool:
        """The run trains a LoRA adapter (--lora-rank > 0), not the full model."""
        return self.lora_rank > 0

    @property
    def syncs_lora_adapter(self) -> bool:
        """The engines serve the trained adapter (LoRA without --lora-train-only): they load it at
        every weight update through SGLang's LoRA API."""
        return self.uses_lora and not self.lora_train_only

    def _check_lora_flags(self) -> None:
        """LoRA (docs/lora.md): the LoRA flags need --lora-rank > 0; the adapter trains on the fsdp backend
        or on the megatron backend (no virtual pipeline stages), and reaches engines through SGLang's LoRA API. (Target names are resolved against the model at start.)"""
        given = changed_flags(self, LORA_FLAGS)
        if self.lora_rank == 0:
            if given:
                raise ConfigError(
                    f"{', '.join(given)}: LoRA flags, but --lora-rank is 0 (LoRA off); set --lora-rank > 0 "
                    "(e.g. --lora-rank 8) or drop them"
                )
            return
        if self.lora_dropout >= 1:
            raise ConfigError(f"--lora-dropout {self.lora_dropout}: must be in [0, 1)")
        if self.train_backend == "megatron":
            if self.num_layers_per_virtual_pipeline_stage:
                raise ConfigError(
                    f"--lora-rank {self.lora_rank} with --num-layers-per-virtual-pipeline-stage "
                    f"{self.num_layers_per_virtual_pipeline_stage}: LoRA on the megatron backend is built for one "
                    "model chunk per pipeline stage; drop the flag or use --train-backend fsdp"
                )
        if self.moe_router_freeze_gate:
            raise ConfigError(
                "--moe-router-freeze-gate with --lora-rank: no effect, LoRA freezes the whole base, the routers "
                "included; drop the flag"
            )
        mode = self.update_weight_transfer_mode
        if mode not in ("tensor", "disk"):
            raise ConfigError(
                f"--update-weight-transfer-mode {mode} with --lora-rank {self.lora_rank}: adapters sync through "
                "SGLang's /load_lora_adapter only (tensor: in-process to embedded engines; disk: the adapter "
                "dir); as in Miles, disk-delta, mooncake and broadcast do not carry LoRA weights"
            )
        if self.check_lora_weight_equal and not self.embedded_engines_only:
            raise ConfigError(
                "--check-lora-weight-equal reads adapter checksums from the embedded engine "
                "(/get_lora_adapter_checksums, not part of SGLang's API); use --rollout-engine embedded"
            )
        if self.check_lora_weight_equal and self.lora_train_only:
            raise ConfigError(
                "--check-lora-weight-equal with --lora-train-only: no adapter is synced to check"
            )
        if self.target_modules is not None and not self.target_modules.strip(" ,"):
            raise ConfigError("--target-modules is empty; omit it for the default (attention + MLP)")
        if self.lora_adapter_path and not os.path.isfile(
            os.path.join(self.lora_adapter_path, "adapter_config.json")
        ):
            raise ConfigError(
                f"--lora-adapter-path {self.lora_adapter_path}: no adapter_config.json there (a PEFT adapter dir)"
            )
