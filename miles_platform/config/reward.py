"""How samples are rewarded and filtered: the rm_hub reward (`--rm-type`) or a custom one, the
reward key of a dict reward, and the filter_hub filters."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import flag

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
