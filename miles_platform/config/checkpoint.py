"""What a run starts from and saves: the trainer backend, the HF checkpoint, reference model,
checkpoint dirs and the seeds."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import POSITIVE, flag, flag_name
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = {"save_interval": POSITIVE, "save_retain_interval": POSITIVE}


@dataclass
class CheckpointFlags:
    train_backend: str = flag(
        "fsdp",
        "checkpoint",
        "trainer backend (fsdp = torch-native, FSDP2 when >1 rank)",
        choices=("fsdp", "megatron"),
    )
    hf_checkpoint: str | None = flag(None, "checkpoint", "HF model dir: tokenizer, config, initial weights")
    ref_load: str | None = flag(
        None, "checkpoint", "reference model (torch_dist for megatron, HF dir otherwise)"
    )
    load: str | None = flag(None, "checkpoint", "actor checkpoint dir to resume from (defaults to --save)")
    save: str | None = flag(None, "checkpoint", "actor checkpoint write dir")
    save_interval: int | None = flag(None, "checkpoint", "rollouts between saves")
    save_retain_interval: int | None = flag(
        None,
        "checkpoint",
        "keep the checkpoints whose rollout id is a multiple of this and the newest; delete the others",
    )
    save_hf: str | None = flag(
        None, "checkpoint", "also export HF weights at each save (path template with {rollout_id})"
    )
    seed: int = flag(1234, "checkpoint", "random seed")


def check_seeds(cfg) -> None:
    """--seed and --rollout-seed: whole numbers numpy, torch and random all take, [0, 2^32 - 1)
    (a seed of 2^70 passed validation and failed in every trainer rank)."""
    for name in ("seed", "rollout_seed"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32 - 1024:
            raise ConfigError(f"{flag_name(name)} {v!r}: must be a whole number in [0, 2^32 - 1024)")
