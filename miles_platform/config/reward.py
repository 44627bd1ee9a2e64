"""How samples are rewarded and filtered: the rm_hub reward (`--rm-type`) or a custom one, the
reward key of a dict reward, and the filter_hub filters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from miles_platform.config.flags import flag
from miles_platform.config.opd import MILES_OPD_REWARD

# The flags other commands share with `train` (one definition each, see `cli.add_flags`)
REWARD_FLAGS = ("rm_type", "rm_url", "custom_rm_path", "group_rm", "reward_key", "eval_reward_key")


@dataclass
class RewardFlags:
    rm_type: str | None = flag(
        None,
        "reward",
        "built-in reward: math, dapo, deepscaler, f1, final_answer, random, remote_rm, boxed_<type> "
        "(required unless --custom-rm-path or per-sample metadata.rm_type gives the reward)",
    )
    rm_url: str | None = flag(None, "reward", "endpoint for --rm-type remote_rm")
    group_rm: bool = flag(False, "reward", "reward computed per group by --custom-rm-path")
    custom_rm_path: str | None = flag(
        None, "reward", "custom reward <module>.<fn> (this or --rm-type is required)"
    )
    reward_key: str | None = flag(None, "reward", "key of a dict reward used for training")
    eval_reward_key: str | None = flag(
        None, "reward", "key of a dict reward used for eval (defaults to --reward-key)"
    )
    dynamic_sampling_filter_path: str | None = flag(
        None, "reward", "group filter <module>.<fn> (e.g. check_reward_nonzero_std)"
    )
    rollout_sample_filter_path: str | None = flag(None, "reward", "per-sample filter setting remove_sample")
    buffer_filter_path: str | None = flag(None, "reward", "buffer dequeue filter <module>.<fn>")

    def reward_settings(self) -> RewardSettings:
        """What the reward hub reads of this run; its user functions receive the run's config itself.
        Miles' OPD reward function is --use-opd's own teacher scoring: pure OPD here."""
        return RewardSettings(
            rm_type=self.rm_type,
            rm_url=self.rm_url,
            custom_rm_path=None if self.custom_rm_path == MILES_OPD_REWARD else self.custom_rm_path,
            group_rm=self.group_rm,
            reward_key=self.reward_key,
            eval_reward_key=self.eval_reward_key,
            use_opd=self.use_opd,
            seed=self.seed,
            prompt_data=self.prompt_data,
            input_key=self.input_key,
            label_key=self.label_key,
            metadata_key=self.metadata_key,
            args=self,
        )


@dataclass(frozen=True)
class RewardSettings:
    """What the reward hub (rollout/rm_hub) reads: which reward scores a sample, how a dict reward
    becomes the training scalar, and what is checked before a run starts. Built from a RunConfig
    (`cfg.reward_settings()`), the eval command's flags or an eval asset's config (`of`).

    `args` is what user reward functions receive, Miles' contract `async def f(args, sample)`: the
    run's RunConfig (every flag, as Miles' args), the eval command's parsed flags; unset, these
    settings themselves, whose attribute names are the flags'."""

    rm_type: str | None = None
    rm_url: str | None = None
    custom_rm_path: str | None = None
    group_rm: bool = False
    reward_key: str | None = None
    eval_reward_key: str | None = None
    use_opd: bool = False  # without a reward flag: pure on-policy distillation, every reward 0
    seed: int = 0  # --rm-type random draws from (seed, rollout id, sample index)
    # the prompt dataset, read when no reward flag is set: every row must name its metadata.rm_type
    prompt_data: str | None = None
    input_key: str = "input"
    label_key: str | None = None
    metadata_key: str = "metadata"
    args: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, args: Any) -> RewardSettings:
        """The settings of `args`: RewardSettings as they are, a RunConfig's, or those of any object
        holding the flags as attributes (an argparse Namespace: the eval command's, or the args a
        ported Miles rollout function passes to `batched_async_rm`), missing ones at their defaults;
        user functions then receive `args` itself."""
        if isinstance(args, RewardSettings):
            return args
        if hasattr(args, "reward_settings"):
            return args.reward_settings()
        names = [f.name for f in dataclasses.fields(cls) if f.name != "args"]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)}, args=args)

    @property
    def user_args(self) -> Any:
        """The `args` of a user reward function."""
        return self if self.args is None else self.args

    @property
    def pure_opd(self) -> bool:
        """--use-opd without --rm-type or --custom-rm-path: every sample's task reward is 0 (Miles' OPD
        reward function returns 0), so the advantages are the teacher's reverse-KL penalty alone."""
        return bool(self.use_opd and not self.rm_type and not self.custom_rm_path)

    @property
    def eval_key(self) -> str | None:
        """The key of a dict reward an eval reports: --eval-reward-key, else --reward-key."""
        return self.eval_reward_key or self.reward_key
