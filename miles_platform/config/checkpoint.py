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
    no_save_optim: bool = flag(
        False,
        "checkpoint",
        "checkpoints without optimizer and LR-scheduler state (resume them with --no-load-optim)",
    )
    no_load_optim: bool = flag(
        False,
        "checkpoint",
        "resume the weights with a fresh optimizer (AdamW moments from zero); said on resume",
    )
    no_load_rng: bool = flag(False, "checkpoint", "resume without the saved RNG states (the seeds' instead)")
    async_save: bool = flag(
        False,
        "checkpoint",
        "write checkpoints in the background from copies taken at the save point (the pointer moves once "
        "the files are durable; the next save or train step finishes it)",
    )
    save_trigger_sentinel: str | None = flag(
        None,
        "checkpoint",
        "a file whose existence at a save point forces a save now (synchronous), deleted once it is durable",
    )

    def _check_checkpoint_flags(self) -> None:
        """Each checkpoint flag where it has an effect (a flag with none in a mode is refused)."""
        from miles_platform.store import remote

        needs_save = [n for n in ("async_save", "save_trigger_sentinel", "no_save_optim") if getattr(self, n)]
        if needs_save and not self.save:
            raise ConfigError(
                f"{', '.join(map(flag_name, needs_save))}: no effect without --save (nothing is saved)"
            )
        resume = [n for n in ("no_load_optim", "no_load_rng") if getattr(self, n)]
        if resume and not (self.load or self.save):
            raise ConfigError(
                f"{', '.join(map(flag_name, resume))}: no effect without --load or --save (nothing to resume)"
            )
        if not self.async_save:
            return
        why = [
            (self.uses_critic, "a critic (--advantage-estimator ppo: its files are written with the policy's)"),
            (remote.is_remote(self.save), f"an object-store --save {self.save} (uploads are staged; save to a local dir)"),
        ]  # fmt: skip
        bad = [w for on, w in why if on]
        if bad:
            raise ConfigError(f"--async-save: not built with {'; '.join(bad)}")


def check_seeds(cfg) -> None:
    """--seed and --rollout-seed: whole numbers numpy, torch and random all take, [0, 2^32 - 1)
    (a seed of 2^70 passed validation and failed in every trainer rank)."""
    for name in ("seed", "rollout_seed"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32 - 1024:
            raise ConfigError(f"{flag_name(name)} {v!r}: must be a whole number in [0, 2^32 - 1024)")
