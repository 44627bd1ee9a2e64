"""On-policy distillation (docs/opd.md): the teacher runs as an engine scoring rollouts (sglang) or
frozen in the trainer (megatron); its reverse KL is subtracted from the advantages. The teacher
routing map (`--opd-teacher-urls NAME=URL ...`) is parsed here, where it is checked."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from miles_platform.config.flags import FINITE, NON_NEGATIVE, changed_flags, flag
from miles_platform.errors import ConfigError

OPD_TYPES = ("sglang", "megatron")
OPD_TOP_K_STRATEGIES = ("only-student", "only-teacher", "intersection", "union", "xor")
OPD_REWARD_WEIGHT_MODES = ("student_p", "teacher_p", "none")
DEFAULT_TEACHER = "default"  # the teacher of a sample whose name has no entry
# Miles' OPD is a reward function (the teacher scores each sample) plus a reward post-process (teacher
# log-probs onto the sample, task reward 0): what --use-opd does here by itself, so a Miles OPD script's
# `--custom-rm-path` / `--custom-reward-post-process-path` naming them mean just that
MILES_OPD_REWARD = "miles.rollout.on_policy_distillation.reward_func"
MILES_OPD_POST_PROCESS = "miles.rollout.on_policy_distillation.post_process_rewards"

RANGES: dict[str, tuple] = {"opd_kl_coef": FINITE, "opd_log_prob_top_k": NON_NEGATIVE}
REFUSED: dict[str, str] = {
    "opd_teacher_ckpt_step": "pass the checkpoint's iter_NNNNNNN dir itself as --opd-teacher-load",
}


@dataclass
class OpdFlags:
    use_opd: bool = flag(
        False, "opd", "on-policy distillation: a teacher's reverse KL is subtracted from advantages"
    )
    opd_type: str | None = flag(
        None,
        "opd",
        "where the teacher runs: sglang = an engine scoring rollouts (--opd-teacher-urls / --rm-url / "
        "--opd-teacher-hf-checkpoint), megatron = frozen in the trainer (--opd-teacher-load; FSDP too)",
        choices=OPD_TYPES,
    )
    opd_kl_coef: float = flag(1.0, "opd", "A_t - opd_kl_coef * reverse_KL_t")
    opd_log_prob_top_k: int = flag(
        0, "opd", "0 = sampled-token OPD; k > 0 = Rethinking-OPD top-k reverse KL (sglang only; paper: 16)"
    )
    opd_top_k_strategy: str = flag(
        "only-student", "opd", "top-k token set per position", choices=OPD_TOP_K_STRATEGIES
    )
    opd_reward_weight_mode: str = flag(
        "student_p", "opd", "weights of the top-k set's tokens", choices=OPD_REWARD_WEIGHT_MODES
    )
    opd_teacher_urls: list[str] = flag(
        [],
        "opd",
        "NAME=URL ... teachers routed by sample.metadata[--opd-teacher-key]; `default` is the fallback "
        "(without it an unknown name is an error); unset = one teacher at --rm-url",
        nargs="*",
    )
    opd_teacher_key: str = flag("opd_teacher", "opd", "metadata key holding a sample's teacher name")
    opd_teacher_load: str | None = flag(
        None,
        "opd",
        "in-trainer teacher (required with --opd-type megatron): an HF dir, or a checkpoint dir of the "
        "--train-backend's save layout (the student's architecture)",
    )
    opd_teacher_ckpt_step: int | None = flag(None, "opd", "checkpoint step of the teacher (Miles)")
    opd_teacher_hf_checkpoint: str | None = flag(
        None,
        "opd",
        "ours: the run starts an embedded teacher engine from this HF dir (sglang mode, one command)",
    )

    @property
    def uses_teacher_engine(self) -> bool:
        """Sglang-mode OPD: a teacher engine scores each rollout's samples."""
        return self.use_opd and self.opd_type == "sglang"

    @property
    def uses_trainer_teacher(self) -> bool:
        """Megatron-mode OPD: the teacher is loaded frozen in the trainer (either backend)."""
        return self.use_opd and self.opd_type == "megatron"

    def teacher_urls(self, started_url: str | None = None) -> dict[str, str]:
        """The routing map of a run: --opd-teacher-urls, else {default: --rm-url or the started engine}."""
        urls = parse_teacher_urls(self.opd_teacher_urls)
        if urls:
            return urls
        url = started_url or self.rm_url
        if not url:
            raise ConfigError(
                "--opd-type sglang: no teacher (--opd-teacher-urls, --rm-url, --opd-teacher-hf-checkpoint)"
            )
        return {DEFAULT_TEACHER: url}

    def _check_opd_flags(self) -> None:
        """Miles' OPD rules (docs/opd.md): every --opd-* flag needs --use-opd; the teacher is an engine
        (sglang) or frozen in the trainer (megatron), never both; top-k OPD is sglang only."""
        opd = [f.name for f in dataclasses.fields(self) if f.name.startswith("opd_")]
        set_ = changed_flags(self, opd)
        if self.custom_rm_path == MILES_OPD_REWARD:
            set_.append(f"--custom-rm-path {MILES_OPD_REWARD}")
        if not self.use_opd:
            if set_:
                raise ConfigError(
                    f"{', '.join(set_)}: on-policy distillation flags; add --use-opd (or drop them)"
                )
            return
        if self.opd_type is None:
            raise ConfigError(
                "--use-opd needs --opd-type sglang (a teacher engine) or megatron (in the trainer)"
            )
        if self.loss_type != "policy_loss":
            raise ConfigError(
                f"--use-opd shapes policy-loss advantages; --loss-type {self.loss_type} has none"
            )
        if self.sampling_support_replay():
            raise ConfigError(
                f"--use-opd with sampling-support replay (--rollout-top-k {self.rollout_top_k}, --rollout-top-p "
                f"{self.rollout_top_p}): the reverse KL compares full-vocabulary log-probs and replay gives the "
                "student a support-normalized one; sample with --rollout-top-k -1 --rollout-top-p 1"
            )
        urls = parse_teacher_urls(self.opd_teacher_urls)
        if self.opd_type == "megatron":
            wrong = [(f, on) for f, on in (("--opd-teacher-urls", bool(urls)), ("--opd-teacher-hf-checkpoint",
                     bool(self.opd_teacher_hf_checkpoint)), (f"--opd-log-prob-top-k {self.opd_log_prob_top_k}",
                     self.opd_log_prob_top_k > 0)) if on]  # fmt: skip
            if wrong:
                raise ConfigError(
                    f"{', '.join(f for f, _ in wrong)}: sglang-mode OPD only (a teacher engine); "
                    "--opd-type megatron loads the teacher in the trainer from --opd-teacher-load"
                )
            if not self.opd_teacher_load:
                raise ConfigError("--opd-type megatron needs --opd-teacher-load (the teacher checkpoint)")
            return
        if self.opd_teacher_load:
            raise ConfigError(
                "--opd-teacher-load must not be set with --opd-type sglang (the teacher is an engine: "
                "--opd-teacher-urls, --rm-url or --opd-teacher-hf-checkpoint); use --opd-type megatron"
            )
        sources = [f for f, on in (("--opd-teacher-urls", bool(urls)), ("--opd-teacher-hf-checkpoint",
                   bool(self.opd_teacher_hf_checkpoint))) if on]  # fmt: skip
        if len(sources) > 1:
            raise ConfigError(f"{' and '.join(sources)}: give one teacher source")
        if not sources and not self.rm_url:
            raise ConfigError(
                "--opd-type sglang needs a teacher: --rm-url http://HOST:PORT/generate (Miles), "
                "--opd-teacher-urls NAME=URL ..., or --opd-teacher-hf-checkpoint DIR (started by the run)"
            )
        if not sources and self.rm_type == "remote_rm":
            raise ConfigError(
                "--rm-type remote_rm and --use-opd both read --rm-url: name the teacher with "
                "--opd-teacher-urls default=URL"
            )


def parse_teacher_urls(entries: Sequence[str] | None) -> dict[str, str]:
    """`--opd-teacher-urls NAME=URL ...` -> {name: url}; the URL may contain `=`."""
    out: dict[str, str] = {}
    for e in entries or ():
        name, sep, url = str(e).partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not name or not url:
            raise ConfigError(
                f"--opd-teacher-urls {e!r}: expected NAME=URL (e.g. math=http://h:30000/generate)"
            )
        if name in out:
            raise ConfigError(f"--opd-teacher-urls: duplicate teacher name {name!r}")
        out[name] = url
    return out
