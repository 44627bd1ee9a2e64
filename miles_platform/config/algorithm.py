"""The RL objective (docs/algorithms.md): loss and advantage estimator, KL and entropy terms,
clipping, the train/rollout mismatch corrections (TIS, MIS, OPSM), the PPO critic and the bounds
of a training call."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import FINITE, NON_NEGATIVE, UNIT, changed_flags, flag, flag_name
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = {
    **dict.fromkeys(("eps_clip", "eps_clip_high", "critic_lr"), NON_NEGATIVE),
    **dict.fromkeys(("gamma", "lambd"), UNIT),
    **dict.fromkeys(("kl_loss_coef", "kl_coef", "entropy_coef"), FINITE),
    "tis_lower_bound": (0, None, False, ">= 0"),
    "tis_upper_bound": (0, None, True, "> 0"),
    "tis_clip": (0, None, True, "> 0"),
    "tis_clip_low": (0, None, False, ">= 0"),
    "rs_lower_bound": (0, None, False, ">= 0"),
    "rs_upper_bound": (0, None, True, "> 0"),
    "rs_veto_threshold": (0, 1, True, "in (0, 1]"),
    "opsm_delta": FINITE,
    "value_clip": (0, None, True, "> 0"),
    "max_nonfinite_steps": NON_NEGATIVE,
    "train_timeout_s": (0, None, False, ">= 0 (seconds; 0 = no bound)"),
}

# Miles' mis.py flags (training/mis.py): any of them set selects the MIS correction
MIS_FLAGS = ("tis_level", "tis_mode", "tis_lower_bound", "tis_upper_bound", "use_rs", "rs_level",
             "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold", "tis_batch_normalize")  # fmt: skip


@dataclass
class AlgorithmFlags:
    loss_type: str = flag(
        "policy_loss",
        "algorithm",
        "loss",
        choices=("policy_loss", "sft_loss", "custom_loss", "score_centering"),
    )
    custom_loss_function_path: str | None = flag(None, "algorithm", "custom loss <module>.<fn>")
    advantage_estimator: str = flag(
        "grpo",
        "algorithm",
        "advantage estimator",
        choices=("grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    )
    disable_grpo_std_normalization: bool = flag(False, "algorithm", "GRPO: subtract group mean only")
    use_kl_loss: bool = flag(False, "algorithm", "KL against the frozen reference")
    kl_loss_coef: float = flag(0.0, "algorithm", "KL weight in the loss (0 = monitor only)")
    kl_loss_type: str = flag("k1", "algorithm", "KL estimator", choices=("k1", "k2", "k3", "low_var_kl"))
    kl_coef: float = flag(0.0, "algorithm", "KL penalty folded into rewards (reinforce++)")
    entropy_coef: float = flag(0.0, "algorithm", "entropy bonus weight")
    observe_training_entropy: bool = flag(
        False,
        "algorithm",
        "log train/entropy_loss (the trained tokens' mean entropy) at --entropy-coef 0, detached from the "
        "backward (Miles')",
    )
    use_rollout_entropy: bool = flag(
        False,
        "algorithm",
        "--train-backend megatron: score the trainer's token entropy with its log-probs before the step "
        "(rollout/entropy); the fsdp backend always does, as Miles'",
    )
    eps_clip: float = flag(0.2, "algorithm", "PPO/GRPO low clip")
    eps_clip_high: float | None = flag(None, "algorithm", "asymmetric high clip (defaults to --eps-clip)")
    eps_clip_c: float | None = flag(None, "algorithm", "dual-clip constant (>1) for negative advantages")
    gamma: float = flag(1.0, "algorithm", "discount (ppo / reinforce++)")
    lambd: float = flag(1.0, "algorithm", "GAE lambda (ppo)")
    calculate_per_token_loss: bool = flag(
        False, "algorithm", "token-mean over the batch instead of per-sample mean"
    )
    use_rollout_logprobs: bool = flag(False, "algorithm", "use engine log-probs as old log-probs")


@dataclass
class CorrectionFlags:
    use_tis: bool = flag(
        False, "algorithm", "importance sampling for the train/rollout mismatch (docs/algorithms.md)"
    )
    tis_clip: float = flag(2.0, "algorithm", "built-in TIS: upper clamp of exp(old - rollout)")
    tis_clip_low: float = flag(0.0, "algorithm", "built-in TIS: lower clamp of exp(old - rollout)")
    custom_tis_function_path: str | None = flag(
        None, "algorithm", "TIS/RS <module>.<fn> with Miles' signature; Miles' mis.py path selects MIS"
    )
    get_mismatch_metrics: bool = flag(False, "algorithm", "log the mis_* train/rollout mismatch metrics only")
    # MIS (Miles' mis.py, training/mis.py): setting any of these selects it
    tis_level: str = flag("token", "algorithm", "MIS: IS level", choices=("token", "sequence", "geometric"))
    tis_mode: str = flag("truncate", "algorithm", "MIS: IS mode", choices=("truncate", "clip", "mask"))
    tis_lower_bound: float | None = flag(0.5, "algorithm", "MIS: IS lower bound (unset: 1 / upper)")
    tis_upper_bound: float = flag(2.0, "algorithm", "MIS: IS upper bound")
    use_rs: bool = flag(False, "algorithm", "MIS: rejection sampling of tokens / sequences out of bounds")
    rs_level: str = flag("token", "algorithm", "MIS: RS level", choices=("token", "sequence", "geometric"))
    rs_lower_bound: float | None = flag(None, "algorithm", "MIS: RS lower bound (unset: the IS one)")
    rs_upper_bound: float | None = flag(None, "algorithm", "MIS: RS upper bound (unset: the IS one)")
    rs_veto_threshold: float | None = flag(
        None, "algorithm", "MIS: reject a sequence with a token ratio below it"
    )
    tis_batch_normalize: bool = flag(False, "algorithm", "MIS: divide IS weights by their batch mean")
    use_opsm: bool = flag(False, "algorithm", "off-policy sequence masking of negative-advantage tokens")
    opsm_delta: float = flag(
        1e-4, "algorithm", "OPSM: masked mean of (old - new) log-prob above which to mask"
    )
    use_unbiased_kl: bool = flag(False, "algorithm", "KL loss weighted by pi / pi_old (DeepSeek-V3.2)")
    normalize_advantages: bool = flag(
        False, "algorithm", "whiten advantages over the batch (after OPD); needed by reinforce_plus_plus*"
    )
    disable_rewards_normalization: bool = flag(
        False, "algorithm", "grpo / gspo / reinforce_plus_plus_baseline: no group mean (or std) removed"
    )
    critic_lr: float | None = flag(None, "algorithm", "critic LR for ppo (defaults to --lr)")
    value_clip: float = flag(0.2, "algorithm", "ppo critic: clip of v - v_old in the value loss")
    train_timeout_s: float = flag(
        3600.0,
        "algorithm",
        "bound of one call on the trainer ranks (a rollout's train, a save, an export); 0 = none",
    )
    max_nonfinite_steps: int = flag(
        3, "algorithm", "optimizer steps skipped for a NaN / inf loss or gradient before the run stops"
    )

    @property
    def uses_critic(self) -> bool:
        """PPO's value model trains beside the policy (--advantage-estimator ppo with the policy loss)."""
        return self.advantage_estimator == "ppo" and self.loss_type == "policy_loss"

    @property
    def uses_reference_model(self) -> bool:
        """A frozen reference model scores each batch: for the KL loss or the KL folded into rewards."""
        return self.use_kl_loss or self.kl_coef > 0

    def mis_flags(self) -> list[str]:
        """The MIS flags set (Miles' mis.py: they select the MIS correction, as its dotted path does)."""
        return changed_flags(self, MIS_FLAGS)

    def _check_algorithm_flags(self) -> None:
        """Miles' rules for estimators and corrections (docs/algorithms.md), and no flag that would
        be accepted without effect."""
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ConfigError(f"--eps-clip-c must be > 1.0, got {self.eps_clip_c}")
        if self.advantage_estimator.startswith("reinforce_plus_plus") and not self.normalize_advantages:
            raise ConfigError(
                f"--advantage-estimator {self.advantage_estimator} needs --normalize-advantages (Miles "
                "requires advantage whitening for both REINFORCE++ estimators)"
            )
        if self.use_rollout_logprobs and self.use_tis:
            raise ConfigError(
                "--use-rollout-logprobs with --use-tis: the ratio's old policy is already the rollout's, "
                "so there is no mismatch left to weight (Miles refuses the pair); drop one"
            )
        mis = self.mis_flags()
        vanilla = changed_flags(self, ("tis_clip", "tis_clip_low"))
        unused = [
            (vanilla + mis + ([flag_name("custom_tis_function_path")] if self.custom_tis_function_path else []),
             not (self.use_tis or self.get_mismatch_metrics), "act only with --use-tis (or --get-mismatch-metrics)"),
            (mis, self.get_mismatch_metrics and not self.use_tis, "weight the loss: they need --use-tis"),
            (vanilla, bool(mis or self.custom_tis_function_path),
             "bound the built-in TIS, which the MIS flags or --custom-tis-function-path replace"),
            (changed_flags(self, ("rs_level", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold")),
             not self.use_rs, "are bounds of --use-rs"),
            (["--use-unbiased-kl"], self.use_unbiased_kl and not self.use_kl_loss, "weights the KL loss: add --use-kl-loss"),
            (["--opsm-delta"], bool(changed_flags(self, ("opsm_delta",))) and not self.use_opsm, "needs --use-opsm"),
            (["--value-clip"], bool(changed_flags(self, ("value_clip",))) and self.advantage_estimator != "ppo",
             "clips the PPO critic: only with --advantage-estimator ppo"),
            (["--tis-batch-normalize"], self.tis_batch_normalize and self.tis_level == "geometric",
             "normalizes token or sequence weights (as Miles), not --tis-level geometric"),
            (["--observe-training-entropy"], self.observe_training_entropy and self.entropy_coef != 0,
             "at a non-zero --entropy-coef the entropy is in the loss and train/entropy_loss is logged already"),
            (["--observe-training-entropy"], self.observe_training_entropy and self.loss_type == "sft_loss",
             "--loss-type sft_loss takes no entropy (nothing to log it from)"),
            (["--use-rollout-entropy"], self.use_rollout_entropy and self.train_backend == "fsdp",
             "the fsdp backend scores rollout/entropy with every log-prob pass already (as Miles'); megatron only"),
            (["--use-rollout-entropy"], self.use_rollout_entropy and self.use_rollout_logprobs and not self.get_mismatch_metrics,
             "scores entropy in the trainer's log-prob pass, which --use-rollout-logprobs skips (add --get-mismatch-metrics)"),
        ]  # fmt: skip
        for flags, bad, why in unused:
            if flags and bad:
                raise ConfigError(f"{', '.join(flags)}: {why}")
        if self.loss_type == "custom_loss" and not self.custom_loss_function_path:
            raise ConfigError("--loss-type custom_loss needs --custom-loss-function-path")
