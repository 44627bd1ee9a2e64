"""Miles' customization hooks loaded by dotted path (plugins.load_function), beside the ones that
belong to a capability of their own (--custom-rm-path, --rollout-function-path, filters, losses,
TIS: their modules). HOOKS names each with the positional arguments Miles calls it with; preflight
imports every one given and checks that it takes them, before Ray starts. docs/customization.md
documents each with where in the loop it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import flag, flag_name
from miles_platform.config.opd import MILES_OPD_POST_PROCESS
from miles_platform.errors import ConfigError

# field -> positional arguments Miles passes (the arity preflight checks), as the docs write them
HOOKS: dict[str, tuple[int, str]] = {
    "rollout_all_samples_process_path": (3, "fn(args, all_samples, data_source) -> None"),
    "rollout_data_postprocess_path": (1, "fn(args) -> None, or fn(args, rollout_data) -> None"),
    "custom_pg_loss_reducer_function_path": (
        4,
        "get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False)"
        " -> Callable[[Tensor], Tensor]",
    ),
    "custom_convert_samples_to_train_data_path": (2, "convert_samples_to_train_data(args, samples) -> dict"),
    "custom_reward_post_process_path": (2, "post_process_rewards(args, samples) -> (raw_rewards, rewards)"),
    "custom_megatron_init_path": (1, "custom_init(args) -> None"),
    "custom_megatron_before_train_step_hook_path": (
        6,
        "custom_hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None",
    ),
    "custom_megatron_post_save_hook_path": (
        4,
        "hook(args, rollout_id, checkpoint_dir, hf_checkpoint_dir) -> None",
    ),
}
MEGATRON_HOOKS = (
    "custom_megatron_init_path",
    "custom_megatron_before_train_step_hook_path",
    "custom_megatron_post_save_hook_path",
)


@dataclass
class HookFlags:
    rollout_all_samples_process_path: str | None = flag(
        None,
        "hooks",
        "<module>.<fn>(args, all_samples, data_source): after the rollout's sample filter, every group "
        "generated, the ones dynamic sampling dropped included (for logging or analysis)",
    )
    rollout_data_postprocess_path: str | None = flag(
        None,
        "hooks",
        "<module>.<fn>(args) as Miles, or fn(args, rollout_data): on each trainer rank after the old / ref "
        "log-probs and advantages, before the optimizer steps; rollout_data holds this rank's samples "
        "(tokens, response_lengths, rewards, log_probs, ref_log_probs, rollout_log_probs, advantages, "
        "loss_masks) and changes to loss_masks and advantages are trained",
    )
    custom_pg_loss_reducer_function_path: str | None = flag(
        None,
        "hooks",
        "<module>.<fn>(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer of "
        "pg_loss only (Dr.GRPO: a constant divisor); the other metrics keep the default reduction",
    )
    custom_convert_samples_to_train_data_path: str | None = flag(
        None,
        "hooks",
        "<module>.<fn>(args, samples) -> dict of per-sample lists (tokens, response_lengths, rewards, "
        "loss_masks, rollout_log_probs, ...): replaces the rollout's samples -> train data conversion",
    )
    custom_reward_post_process_path: str | None = flag(
        None,
        "hooks",
        "<module>.<fn>(args, samples) -> (raw_rewards, rewards): replaces the reward normalization (GRPO's group "
        "mean / std); the advantage estimator takes `rewards` as they are. Miles' OPD post-process "
        f"({MILES_OPD_POST_PROCESS}) is what --use-opd does here",
    )
    custom_megatron_init_path: str | None = flag(
        None, "hooks", "--train-backend megatron: <module>.<fn>(args) on each rank after megatron's init"
    )
    custom_megatron_before_train_step_hook_path: str | None = flag(
        None,
        "hooks",
        "--train-backend megatron: <module>.<fn>(args, rollout_id, step_id, model, optimizer, "
        "opt_param_scheduler) on each rank before every optimizer step",
    )
    custom_megatron_post_save_hook_path: str | None = flag(
        None,
        "hooks",
        "--train-backend megatron: <module>.<fn>(args, rollout_id, checkpoint_dir, hf_checkpoint_dir) on "
        "rank 0 after each checkpoint save",
    )

    def hook_paths(self) -> dict[str, str]:
        """The hooks given, as {flag: dotted path} (Miles' OPD post-process is --use-opd's, not loaded)."""
        return {flag_name(n): getattr(self, n) for n in HOOKS if getattr(self, n) and not self.is_opd_hook(n)}

    def is_opd_hook(self, name: str) -> bool:
        return (
            name == "custom_reward_post_process_path"
            and self.custom_reward_post_process_path == MILES_OPD_POST_PROCESS
        )

    def _check_hook_flags(self) -> None:
        """Each hook where it has an effect; refused, naming why, where it would have none."""
        if self.train_backend != "megatron":
            given = [flag_name(n) for n in MEGATRON_HOOKS if getattr(self, n)]
            if given:
                raise ConfigError(
                    f"{', '.join(given)}: megatron hooks (they get megatron's model, optimizer and "
                    f"checkpoint dir); --train-backend {self.train_backend} has none of them: use "
                    "--train-backend megatron, or --rollout-data-postprocess-path for a hook on every backend"
                )
        trainer = [
            flag_name(n) for n in HOOKS if getattr(self, n) and n != "rollout_all_samples_process_path"
        ]
        if trainer and self.debug_rollout_only:
            raise ConfigError(f"{', '.join(trainer)}: trainer hooks; --debug-rollout-only trains nothing")
        if self.rollout_all_samples_process_path and self.debug_train_only:
            raise ConfigError(
                "--rollout-all-samples-process-path: runs in the rollout; --debug-train-only generates nothing"
            )
        self._check_reward_post_process()
        if self.custom_pg_loss_reducer_function_path and self.loss_type != "policy_loss":
            raise ConfigError(
                f"--custom-pg-loss-reducer-function-path: reduces the policy loss's pg_loss, which --loss-type "
                f"{self.loss_type} does not compute; use --loss-type policy_loss"
            )
        if self.rollout_all_samples_process_path and self.fully_async:
            raise ConfigError(
                "--rollout-all-samples-process-path: not with --fully-async (as Miles): the async worker "
                "hands groups over one by one, there is no rollout's 'all samples' to show the function"
            )
        if self.rollout_all_samples_process_path and self.rollout_function_path:
            raise ConfigError(
                "--rollout-all-samples-process-path runs inside the built-in rollout; a --rollout-function-path "
                "replaces it: call your processing from that function"
            )

    def _check_reward_post_process(self) -> None:
        path, flag_ = self.custom_reward_post_process_path, "--custom-reward-post-process-path"
        if not path:
            return
        if path == MILES_OPD_POST_PROCESS:
            if not self.use_opd:
                raise ConfigError(
                    f"{flag_} {path}: Miles' OPD post-process (teacher log-probs onto each sample, task reward 0) "
                    "is what --use-opd does here: add --use-opd and its --opd-* flags"
                )
            return
        why = [
            (self.use_opd, "--use-opd applies Miles' OPD post-process, which another hook would replace"),
            (bool(self.custom_convert_samples_to_train_data_path),
             "Miles calls it inside the built-in samples -> train data conversion, which "
             "--custom-convert-samples-to-train-data-path replaces: post-process the rewards there"),
            (self.loss_type == "sft_loss", "--loss-type sft_loss trains on no reward"),
            (self.debug_rollout_only, "--debug-rollout-only trains nothing"),
        ]  # fmt: skip
        for bad, reason in why:
            if bad:
                raise ConfigError(f"{flag_} {path}: {reason}")
