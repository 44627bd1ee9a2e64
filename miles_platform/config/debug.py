"""Debug and CI switches: rollout-only and train-only runs, rollout dumps and replays, a frozen
optimizer, the --ci-test invariants and the --ci-fault-hooks fault requests (fault_hooks.py)."""

from __future__ import annotations

import string
from dataclasses import dataclass

from miles_platform.config.flags import FINITE, POSITIVE, flag
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = {
    "log_interval": POSITIVE,
    "load_debug_rollout_data_subsample": (0, 1, True, "in (0, 1]"),
    "ci_entropy_max": (0, None, True, "> 0"),
    "ci_metric_checker_threshold": FINITE,
    "ci_metric_checker_expect_num": POSITIVE,
    "ci_inject_rollout_data_start_rollout_id": (0, None, False, ">= 0"),
    "ci_inject_rollout_data_min_match_ratio": (0, 1, False, "in [0, 1]"),
}


@dataclass
class DebugFlags:
    debug_rollout_only: bool = flag(False, "debug", "generate and store rollouts, no training")
    debug_train_only: bool = flag(
        False,
        "debug",
        "no engines: train on loaded rollouts (--load-debug-rollout-data) or on what a --rollout-function-path "
        "returns without one (Miles' SFT)",
    )
    save_debug_rollout_data: str | None = flag(
        None, "debug", "Parquet path template with {rollout_id}, one file per rollout"
    )
    save_debug_train_data: str | None = flag(
        None,
        "debug",
        "path template with {rollout_id} and {rank}: each trainer rank writes every sample it trained in a "
        "rollout as one Parquet file of train_samples rows (Miles writes a torch.save dict: no pickle here)",
    )
    load_debug_rollout_data: str | None = flag(
        None, "debug", "replay Parquet rollouts (implies --debug-train-only)"
    )
    load_debug_rollout_data_subsample: float | None = flag(
        None,
        "debug",
        "with --load-debug-rollout-data: train on this fraction of each replayed rollout's prompt groups "
        "(half from its start, half from its end, as Miles; --rollout-batch-size must be what is kept)",
    )
    debug_skip_optimizer_step: bool = flag(
        False, "debug", "freeze weights: any log-prob gap is forward-path difference"
    )
    ci_test: bool = flag(
        False,
        "debug",
        "assert each rollout's step-0 KL/clipfrac, log-prob agreement, entropy, weight equality",
    )
    ci_disable_weight_update_checker: bool = flag(
        False, "debug", "--ci-test without the weight check (for SGLang models lacking get_weights_by_name)"
    )
    ci_logprob_abs_diff_threshold: float = flag(
        0.03,
        "debug",
        "--ci-test bound on |rollout/log_probs - rollout/rollout_log_probs| (means), every rollout",
    )
    ci_disable_kl_checker: bool = flag(
        False,
        "debug",
        "--ci-test without the KL checks (each rollout's step-0 ppo_kl, pg_clipfrac; rollout 0's kl_loss == 0)",
    )
    ci_disable_logprobs_checker: bool = flag(
        False,
        "debug",
        "--ci-test without the log-prob checks (trainer vs engine and entropy range each rollout, vs reference at 0)",
    )
    ci_entropy_max: float = flag(
        0.7,
        "debug",
        "--ci-test: upper bound of the trainer's mean token entropy at every rollout (Miles' 0.7, for trained "
        "models; an untrained model is near-uniform, ln(vocab))",
    )
    ci_metric_checker_key: str | None = flag(
        None,
        "debug",
        "--ci-test gate: an eval metric (eval/<dataset>/<metric>) that must reach the threshold",
    )
    ci_metric_checker_threshold: float | None = flag(
        None, "debug", "--ci-test gate: at least one eval must report --ci-metric-checker-key >= this"
    )
    ci_metric_checker_expect_num: int | None = flag(
        None,
        "debug",
        "--ci-test gate: exactly this many evals must check --ci-metric-checker-key, every one reaching the threshold",
    )
    ci_save_grad_norm: str | None = flag(
        None,
        "debug",
        "--ci-test: rank 0 torch.saves each optimizer step's grad norm to this path template "
        "({role}, {rollout_id}, {step_id})",
    )
    ci_load_grad_norm: str | None = flag(
        None,
        "debug",
        "--ci-test: each optimizer step's grad norm must match what --ci-save-grad-norm wrote there "
        "(rel_tol = abs_tol = 0.03, Miles')",
    )
    ci_save_model_hash: bool = flag(
        False,
        "debug",
        "--ci-test: each save writes per-layer SHA-256 hashes of every rank's parameters "
        "(iter_*/model_hash_tp*_pp*_dp*_cp0.json)",
    )
    ci_check_model_hash: bool = flag(
        False, "debug", "--ci-test: a loaded checkpoint's weights must hash as its model_hash files say"
    )
    ci_inject_rollout_data_path: str | None = flag(
        None,
        "debug",
        "path template with {rollout_id} of rollouts --save-debug-rollout-data recorded: from "
        "--ci-inject-rollout-data-start-rollout-id on, each rollout still generates, is compared with the "
        "recording (mean response-token match) and the recording is trained on",
    )
    ci_inject_rollout_data_start_rollout_id: int | None = flag(
        None, "debug", "the first rollout --ci-inject-rollout-data-path replaces"
    )
    ci_inject_rollout_data_min_match_ratio: float = flag(
        0.9,
        "debug",
        "--ci-inject-rollout-data-path: the generated responses' mean token match must exceed it",
    )
    ci_fault_hooks: str | None = flag(
        None,
        "debug",
        "JSON array of fault requests ({hook_name, action: {kind}, rollout_id}); "
        "miles_platform/fault_hooks.py lists the hooks and actions",
    )
    log_interval: int = flag(1, "debug", "print metrics every N rollouts")

    def _check_ci_flags(self) -> None:
        """The --ci-* switches act under --ci-test only; the metric gate needs its threshold and an eval."""
        given = _ci_flags_given(self)
        if given and not self.ci_test:
            raise ConfigError(f"{', '.join(given)}: switches of --ci-test's checks; add --ci-test")
        if (self.ci_metric_checker_key is None) != (self.ci_metric_checker_threshold is None):
            raise ConfigError(
                "--ci-metric-checker-key and --ci-metric-checker-threshold: give both (as Miles)"
            )
        if self.ci_metric_checker_expect_num is not None and self.ci_metric_checker_key is None:
            raise ConfigError(
                "--ci-metric-checker-expect-num: counts --ci-metric-checker-key's checks; add it"
            )
        if self.ci_save_grad_norm and self.ci_load_grad_norm:
            raise ConfigError(
                "--ci-save-grad-norm and --ci-load-grad-norm: one run records, a later one compares (Miles "
                "takes the save and ignores the load): give one"
            )
        for option, template in (("--ci-save-grad-norm", self.ci_save_grad_norm),
                                 ("--ci-load-grad-norm", self.ci_load_grad_norm)):  # fmt: skip
            if template:
                _check_template(option, template, {"role", "rollout_id", "step_id"})
        if self.ci_save_model_hash and not self.save:
            raise ConfigError("--ci-save-model-hash writes into each checkpoint's iter dir: add --save")
        if self.ci_check_model_hash and not (self.load or self.save):
            raise ConfigError("--ci-check-model-hash checks the checkpoint a run loads: add --load")
        if (
            self.ci_save_grad_norm
            or self.ci_load_grad_norm
            or self.ci_save_model_hash
            or self.ci_check_model_hash
        ) and self.debug_rollout_only:
            raise ConfigError(
                "--ci-*-grad-norm / --ci-*-model-hash check the trainer; --debug-rollout-only trains nothing"
            )
        if self.ci_metric_checker_key and not (self.eval_prompt_data and self.eval_interval):
            raise ConfigError(
                f"--ci-metric-checker-key {self.ci_metric_checker_key}: checks eval metrics, and this run has no "
                "eval (a run with no eval always fails the gate): add --eval-prompt-data and --eval-interval"
            )
        inject = self.ci_inject_rollout_data_path
        if (inject is None) != (self.ci_inject_rollout_data_start_rollout_id is None):
            raise ConfigError(
                "--ci-inject-rollout-data-path and --ci-inject-rollout-data-start-rollout-id: give both (as Miles)"
            )
        if inject and (self.load_debug_rollout_data or self.debug_train_only or self.debug_rollout_only):
            raise ConfigError(
                "--ci-inject-rollout-data-path: compares live generation with a recording and trains on it; "
                "--load-debug-rollout-data / --debug-*-only leave no generation or no training to do it with"
            )
        if inject:
            check_rollout_template("--ci-inject-rollout-data-path", inject)
        if not inject and self.ci_inject_rollout_data_min_match_ratio != 0.9:
            raise ConfigError(
                "--ci-inject-rollout-data-min-match-ratio: bounds --ci-inject-rollout-data-path; add it"
            )
        if self.load_debug_rollout_data_subsample is not None and not self.load_debug_rollout_data:
            raise ConfigError(
                "--load-debug-rollout-data-subsample: subsamples --load-debug-rollout-data; add it"
            )

    def _check_debug_flags(self) -> None:
        """A replay implies train-only; train-only needs something to replay; a dump names each
        rollout; fault requests parse (where each can fire: preflight._check_fault_targets)."""
        if self.load_debug_rollout_data:
            self.debug_train_only = True
        if self.debug_rollout_only and self.debug_train_only:
            raise ConfigError("--debug-rollout-only and --debug-train-only exclude each other")
        if self.debug_train_only and not (self.load_debug_rollout_data or self.rollout_function_path):
            raise ConfigError(
                "--debug-train-only needs --load-debug-rollout-data (the Parquet path template that "
                "--save-debug-rollout-data wrote) or a --rollout-function-path that needs no engine (Miles' "
                "SFT: miles.rollout.sft_rollout.generate_rollout): no engines start, so there is nothing else "
                "to train on"
            )
        if self.debug_train_only and (self.eval_interval or self.eval_prompt_data):
            raise ConfigError(
                "--eval-interval / --eval-prompt-data with --debug-train-only: no engine starts to generate eval "
                "answers (Miles' SFT rollout function has no eval either); each policy version is an HF export "
                "that `miles-platform eval` or the eval sensor evaluates: drop the eval flags"
            )
        if self.save_debug_rollout_data:
            check_rollout_template("--save-debug-rollout-data", self.save_debug_rollout_data)
        if self.save_debug_train_data:
            ranks = self.actor_num_nodes * self.actor_num_gpus_per_node
            check_rollout_template("--save-debug-train-data", self.save_debug_train_data, ranks > 1)
        self._check_ci_flags()
        from miles_platform.fault_hooks import parse_fault_hooks

        parse_fault_hooks(self.ci_fault_hooks)


def _ci_flags_given(cfg) -> list[str]:
    from miles_platform.config.flags import changed_flags

    names = ("ci_disable_weight_update_checker", "ci_disable_kl_checker", "ci_disable_logprobs_checker",
             "ci_entropy_max", "ci_logprob_abs_diff_threshold", "ci_metric_checker_key", "ci_metric_checker_threshold",
             "ci_metric_checker_expect_num", "ci_save_grad_norm", "ci_load_grad_norm", "ci_save_model_hash",
             "ci_check_model_hash")  # fmt: skip
    return changed_flags(cfg, names)


def _check_template(option: str, template: str, fields: set[str]) -> None:
    """A path template that names only `fields` (str.format would fail on another mid-run)."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ConfigError(f"{option} {template!r}: not a valid path template ({e})") from None
    if names - fields:
        raise ConfigError(
            f"{option} {template!r}: unknown fields {sorted(names - fields)}; it may name {sorted(fields)}"
        )


def check_rollout_template(option: str, template: str, per_rank: bool | None = None) -> None:
    """A per-rollout path template: must name {rollout_id} (else every rollout overwrites one file)
    and nothing else (str.format would fail on it mid-run). `per_rank` (a per-rank file): {rank} is
    allowed too, and required when True (several ranks would write one file)."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ConfigError(f"{option} {template!r}: not a valid path template ({e})") from None
    fields = {"rollout_id"} if per_rank is None else {"rollout_id", "rank"}
    if "rollout_id" not in names or names - fields:
        also = "" if per_rank is None else " (and {rank})"
        raise ConfigError(
            f"{option} {template!r} must contain {{rollout_id}}{also} and no other {{field}}: one file per rollout, "
            "e.g. /tmp/rollout_{rollout_id}.parquet (a fixed path would be overwritten every rollout)"
        )
    if per_rank and "rank" not in names:
        raise ConfigError(
            f"{option} {template!r} must contain {{rank}}: several trainer ranks each write their file, "
            "e.g. /tmp/train_{rollout_id}_{rank}.parquet"
        )
