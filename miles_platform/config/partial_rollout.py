"""Miles' partial rollout: the generations dynamic sampling or over-sampling aborts at the end of a
rollout are kept and continued in the next one (rollout/partial_rollout.py)."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import flag
from miles_platform.errors import ConfigError


@dataclass
class PartialRolloutFlags:
    partial_rollout: bool = flag(
        False,
        "async",
        "keep the responses a rollout aborts once it has its groups (over-sampling, dynamic sampling) and "
        "continue them in the next rollout: input prompt + partial response, log-probs and weight versions "
        "stitched (docs/rollout.md)",
    )
    mask_offpolicy_in_partial_rollout: bool = flag(
        False,
        "async",
        "--partial-rollout: a continued response trains only on the tokens generated in the rollout that "
        "finishes it (loss mask 0 on those an older policy generated)",
    )

    def _check_partial_rollout(self) -> None:
        """Refused where nothing is ever aborted and continued, naming why (before Ray starts)."""
        if not self.partial_rollout:
            if self.mask_offpolicy_in_partial_rollout:
                raise ConfigError(
                    "--mask-offpolicy-in-partial-rollout masks the older policy's tokens of a continued partial "
                    "response: it needs --partial-rollout"
                )
            return
        flag_ = "--partial-rollout"
        why = next((w for on, w in self._partial_rollout_clashes() if on), None)
        if why:
            raise ConfigError(f"{flag_}: {why}")
        rbs = self.rollout_batch_size or 0
        if (self.over_sampling_batch_size or rbs) <= rbs and not self.dynamic_sampling_filter_path:
            raise ConfigError(
                f"{flag_}: nothing is aborted at the end of a rollout: without --dynamic-sampling-filter-path "
                f"every group submitted is trained, unless --over-sampling-batch-size "
                f"({self.over_sampling_batch_size}) exceeds --rollout-batch-size ({rbs}). Add one of them or "
                "drop the flag"
            )

    def _partial_rollout_clashes(self) -> list[tuple[bool, str]]:
        return [
            (self.fully_async, "--fully-async never aborts generation at a rollout's end (its worker keeps "
             "generating into the data buffer); Miles refuses the combination too"),
            (self.debug_train_only or bool(self.load_debug_rollout_data),
             "this run generates nothing (--debug-train-only / --load-debug-rollout-data)"),
            (bool(self.rollout_function_path), "--rollout-function-path replaces the rollout whose aborted "
             "generations partial rollout continues"),
            (bool(self.custom_generate_function_path), "a --custom-generate-function-path sample has no "
             "contract to be continued from a partial response (Miles' multi-turn generate refuses it too)"),
            (self.use_session_server, "--use-session-server sessions cannot be continued (Miles refuses it too)"),
            (bool(self.multimodal_keys), "continuing an image prompt's partial response is not built here"),
        ]  # fmt: skip
