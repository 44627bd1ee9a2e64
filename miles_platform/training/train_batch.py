"""One rollout's training data as the trainer ranks receive it: per-sample token lists, in group
order, built from the rollout's Samples (Miles' `_convert_samples_to_train_data`), or by the
function --custom-convert-samples-to-train-data-path names (Miles' signature:
`convert_samples_to_train_data(args, samples) -> dict`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainBatch:
    """One rollout's training data: per-sample token lists, in group order."""

    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[list[int]]
    rewards: list[float]
    rollout_log_probs: list[list[float]]
    # sampling-support replay: per sample, per response token, the token ids it was drawn from
    # (None: sampled from the full vocabulary)
    rollout_sampling_supports: list[list[list[int]] | None] | None = None
    # on-policy distillation, sglang mode (per sample, per response token; None: not scored)
    teacher_log_probs: list[list[float] | None] | None = None
    opd_reverse_kl: list[list[float] | None] | None = None
    # R3 (MoE): per sample, the engine's top-k experts per token, [tokens - 1][num_layers][top_k]
    routed_experts: list[list | None] | None = None
    # score centering: per sample, the engine's K candidates per response token (ids, log-probs)
    rollout_topk_token_ids: list[list[list[int]] | None] | None = None
    rollout_topk_log_probs: list[list[list[float]] | None] | None = None
    sample_indices: list[int] | None = None  # each Sample's index in its rollout (train_samples rows)
    # --custom-reward-post-process-path gave `rewards`: the estimator takes them without normalizing
    rewards_normalized: bool = False
    # vision-language prompts: per sample its images as data URIs (None: a text sample; the whole
    # field None: no sample has images); tokens carry the expanded image pads
    images: list[list[str] | None] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_samples(cls, samples) -> TrainBatch:
        supports = [s.rollout_sampling_support for s in samples]
        teacher = [s.teacher_log_probs for s in samples]
        topk = [s.opd_reverse_kl for s in samples]
        routes = [s.rollout_routed_experts for s in samples]
        cand_ids = [s.rollout_topk_token_ids for s in samples]
        cand_lps = [s.rollout_topk_log_probs for s in samples]
        images = [s.image_data or None for s in samples]
        return cls(
            tokens=[s.tokens for s in samples],
            response_lengths=[s.response_length for s in samples],
            loss_masks=[list(s.loss_mask) for s in samples],
            rewards=[s.raw_reward if s.raw_reward is not None else 0.0 for s in samples],
            rollout_log_probs=[list(s.rollout_log_probs) for s in samples],
            rollout_sampling_supports=supports if any(x is not None for x in supports) else None,
            teacher_log_probs=teacher if any(x is not None for x in teacher) else None,
            opd_reverse_kl=topk if any(x is not None for x in topk) else None,
            routed_experts=routes if any(x is not None for x in routes) else None,
            rollout_topk_token_ids=cand_ids if any(x is not None for x in cand_ids) else None,
            rollout_topk_log_probs=cand_lps if any(x is not None for x in cand_lps) else None,
            sample_indices=[s.index for s in samples],
            images=images if any(images) else None,
        )


# Miles' train-data keys -> TrainBatch fields (the per-sample lists the trainer reads)
TRAIN_DATA_FIELDS = {
    "tokens": "tokens", "response_lengths": "response_lengths", "rewards": "rewards", "loss_masks": "loss_masks",
    "rollout_log_probs": "rollout_log_probs", "sample_indices": "sample_indices",
    "teacher_log_probs": "teacher_log_probs", "rollout_routed_experts": "routed_experts",
}  # fmt: skip
# Miles' keys that describe the samples for its logging only (no trainer reads them there either)
TRAIN_DATA_INFO = ("raw_reward", "truncated", "round_number", "metadata")
CONVERT_FLAG = "--custom-convert-samples-to-train-data-path"


def train_data(cfg, samples) -> TrainBatch:
    """The rollout's train data: TrainBatch.from_samples, or what --custom-convert-samples-to-train-data-path
    returns for (args, samples), checked (every list one entry per sample, masks as long as responses)."""
    from miles_platform.errors import ConfigError
    from miles_platform.plugins import load_hook

    fn = load_hook(cfg, "custom_convert_samples_to_train_data_path")
    if fn is None:
        return post_process_rewards(cfg, samples, TrainBatch.from_samples(samples))
    out = fn(cfg, samples)
    path = cfg.custom_convert_samples_to_train_data_path
    if not isinstance(out, dict):
        raise ConfigError(f"{CONVERT_FLAG} {path!r} returned a {type(out).__name__}, not a dict")
    unknown = sorted(set(out) - set(TRAIN_DATA_FIELDS) - set(TRAIN_DATA_INFO))
    missing = [k for k in ("tokens", "response_lengths", "rewards", "loss_masks") if k not in out]
    if unknown or missing:
        raise ConfigError(
            f"{CONVERT_FLAG} {path!r}: " + (f"missing keys {missing}; " if missing else "")
            + (f"keys this build does not train on {unknown}; " if unknown else "")
            + f"the keys: {sorted(TRAIN_DATA_FIELDS)} (and Miles' logging keys {list(TRAIN_DATA_INFO)})"
        )  # fmt: skip
    n = len(out["tokens"])
    kw = {field: out[key] for key, field in TRAIN_DATA_FIELDS.items() if out.get(key) is not None}
    kw.setdefault("rollout_log_probs", [[] for _ in range(n)])  # none: no trainer-vs-engine metrics
    for field, value in kw.items():
        if len(value) != n:
            raise ConfigError(f"{CONVERT_FLAG} {path!r}: {field} has {len(value)} entries for {n} samples")
    batch = TrainBatch(**kw)
    for i in range(n):
        r = batch.response_lengths[i]
        lp = batch.rollout_log_probs[i]
        if not 0 < r < len(batch.tokens[i]) or len(batch.loss_masks[i]) != r or (len(lp) and len(lp) != r):
            raise ConfigError(
                f"{CONVERT_FLAG} {path!r}: sample {i}: response_lengths {r} with {len(batch.tokens[i])} tokens, "
                f"{len(batch.loss_masks[i])} loss-mask and {len(lp)} log-prob entries (want 0 < response < "
                "tokens, one mask entry per response token)"
            )
    return batch


POST_PROCESS_FLAG = "--custom-reward-post-process-path"


def post_process_rewards(cfg, samples, batch: TrainBatch) -> TrainBatch:
    """--custom-reward-post-process-path: Miles' `post_process_rewards(args, samples) -> (raw_rewards,
    rewards)` in place of the reward normalization; `rewards` (one finite number per sample) are what the
    advantage estimator takes. `raw_rewards` is what Miles logs: here each sample's raw_reward is logged
    as scored, so it is checked for length only."""
    import math

    from miles_platform.errors import ConfigError
    from miles_platform.plugins import load_hook

    fn = load_hook(cfg, "custom_reward_post_process_path")
    if fn is None:
        return batch
    out, path = fn(cfg, samples), cfg.custom_reward_post_process_path
    ok = isinstance(out, tuple | list) and len(out) == 2 and all(len(x) == len(samples) for x in out)
    if not ok:
        raise ConfigError(
            f"{POST_PROCESS_FLAG} {path!r}: returned {type(out).__name__}; want (raw_rewards, rewards), each one "
            f"number per sample ({len(samples)})"
        )
    rewards = [float(r) for r in out[1]]
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise ConfigError(f"{POST_PROCESS_FLAG} {path!r}: non-finite rewards for samples {bad[:5]}")
    batch.rewards, batch.rewards_normalized = rewards, True
    return batch
