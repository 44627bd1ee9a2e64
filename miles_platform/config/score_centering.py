"""Score centering (`--loss-type score_centering`, docs/algorithms.md; training/score_centering.py):
the engine's K candidate log-probs per token and the centered loss's importance weight, with Miles'
rules for what it cannot be combined with."""

from __future__ import annotations

import math
from dataclasses import dataclass

from miles_platform.config.flags import changed_flags, flag
from miles_platform.errors import ConfigError


@dataclass
class ScoreCenteringFlags:
    rollout_top_logprobs_num: int = flag(
        0,
        "sampling",
        "K candidate log-probs the engine records per generated token (rollout_topk_*); 0 = off. "
        "Read by --loss-type score_centering: the sampler's top K (unfiltered) or its whole support (top-k/p)",
    )
    score_centering_is: str = flag(
        "none", "algorithm", "score centering importance weight f: none (1), tis (clipped), mis (masked)",
        choices=("none", "tis", "mis"),
    )  # fmt: skip
    score_centering_tis_clip: float = flag(2.0, "algorithm", "score centering tis: f(x) = min(x, clip)")
    score_centering_mis_low: float = flag(
        0.5, "algorithm", "score centering mis: f(x) = x on [low, high], else 0"
    )
    score_centering_mis_high: float = flag(
        5.0, "algorithm", "score centering mis: upper end of the kept ratios"
    )

    def _check_score_centering(self) -> None:
        """Score centering (docs/algorithms.md, Miles' rules): its flags only with --loss-type
        score_centering; what it cannot be combined with is refused before anything starts."""
        names = ("rollout_top_logprobs_num", "score_centering_is", "score_centering_tis_clip",
                 "score_centering_mis_low", "score_centering_mis_high")  # fmt: skip
        given = changed_flags(self, names)
        if self.loss_type != "score_centering":
            if given:
                raise ConfigError(
                    f"{', '.join(given)}: score centering flags (the candidates are read by that loss "
                    "only); add --loss-type score_centering or drop them"
                )
            return
        sc, k = "--loss-type score_centering", self.rollout_top_logprobs_num
        if k <= 0:
            raise ConfigError(
                f"{sc} needs --rollout-top-logprobs-num K > 0 (got {k}): the engine's K candidate "
                "log-probs per token are H, what the score is centered over (Miles' recipe: 128)"
            )
        if not self.use_rollout_logprobs:
            raise ConfigError(
                f"{sc} needs --use-rollout-logprobs: q, the distribution that sampled, is what the "
                "engine recorded (rollout log-probs and top-K), never a trainer recomputation"
            )
        if self.advantage_estimator != "grpo":
            raise ConfigError(
                f"{sc} with --advantage-estimator {self.advantage_estimator}: the initial advantage "
                "estimator must be grpo (as in Miles); use --advantage-estimator grpo"
            )
        refused = (
            ("--use-opd", self.use_opd, "OPD shapes advantages with a full-vocabulary reverse KL"),
            ("--use-tis", self.use_tis, "use --score-centering-is tis or mis (weights centered with the score)"),
            ("--use-opsm", getattr(self, "use_opsm", False), "sequence masking is not part of the centered loss"),
            ("--use-session-server", bool(self.use_session_server),
             "session requests do not record candidate log-probs here; use the default or multi_turn generate"),
        )  # fmt: skip
        for option, on, why in refused:
            if on:
                raise ConfigError(f"{option} with {sc}: {why}")
        if self.sampling_support_replay() and k < self.rollout_top_k:
            raise ConfigError(
                f"--rollout-top-logprobs-num {k} < --rollout-top-k {self.rollout_top_k}: filtered sampling "
                "records each token's whole support (support mode), so K must hold --rollout-top-k ids"
            )
        if not (math.isfinite(self.score_centering_tis_clip) and self.score_centering_tis_clip > 0):
            raise ConfigError(f"--score-centering-tis-clip {self.score_centering_tis_clip}: must be > 0")
        lo, hi = self.score_centering_mis_low, self.score_centering_mis_high
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo <= hi):
            raise ConfigError(
                f"--score-centering-mis-low {lo} / --score-centering-mis-high {hi}: need 0 <= low <= high"
            )
