"""--ci-test and --check-weight-update-equal, as in Miles: at each rollout's first step the trainer's
policy is the one its log-probs were scored with, so PPO's KL and clip fraction are 0, and the trainer's
log-probs agree with the engine's (and at rollout 0 with the reference's); after every update the
engines hold exactly the trainer's weights (over HTTP, for embedded, external and SGLang engines)."""

from __future__ import annotations

import json
from collections.abc import Callable

from miles_platform.config import RunConfig
from miles_platform.run_types import CITestFailure


def weight_check_on(cfg: RunConfig) -> bool:
    """--check-weight-update-equal, or --ci-test unless --ci-disable-weight-update-checker (as Miles)."""
    return cfg.check_weight_update_equal or (cfg.ci_test and not cfg.ci_disable_weight_update_checker)


REF_LOGPROB_TOL = 1e-8  # Miles: trainer vs reference log-probs at rollout 0 (5e-3 under R3)
R3_REF_LOGPROB_TOL = 5e-3  # R3: the reference model does not replay the rollout's routes


def rollout_checks(
    cfg: RunConfig, rollout_id: int, m: dict[str, float], log: Callable[[str], None]
) -> dict[str, float]:
    """Miles' --ci-test checkers of one rollout's training metrics (its check_kl and log_rollout_data;
    docs/miles_flags.md). Every rollout: the first optimizer step's ppo_kl and pg_clipfrac are 0
    (--ci-disable-kl-checker); the trainer's rollout/log_probs within --ci-logprob-abs-diff-threshold
    (Miles' 0.03) of the engine's rollout/rollout_log_probs and rollout/entropy in (0, --ci-entropy-max),
    each where measured (--ci-disable-logprobs-checker). Rollout 0 only: kl_loss is 0 and
    rollout/log_probs is within 1e-8 of rollout/ref_log_probs (5e-3 under R3).

    The log-prob checks compare reduced means, as Miles does: each of rollout/log_probs,
    rollout/ref_log_probs and rollout/rollout_log_probs is the mean over samples of each sample's
    masked token mean, averaged over ranks (rollout_metrics.py), and |a - b| is bounded. The token-level
    mean |log p - log q| (train/train_rollout_logprob_abs_diff) is stricter (no cancellation between
    tokens or samples) but a bound on it is not Miles' bound, so it is reported in the returned dict and
    the log line, not gated: a config passes or fails --ci-test here as it does in Miles.
    Raises CITestFailure naming the rollout and the first check that fails."""
    get = m.get
    checks = {
        "step0_ppo_kl": abs(get("train/step0_ppo_kl", 0.0)),
        "step0_pg_clipfrac": get("train/step0_pg_clipfrac", 0.0),
    }
    if rollout_id == 0:
        checks["step0_kl_loss"] = abs(get("train/step0_kl_loss", 0.0))
        if "rollout/log_probs" in m and "rollout/ref_log_probs" in m:
            checks["step0_ref_logprob_abs_diff"] = abs(m["rollout/log_probs"] - m["rollout/ref_log_probs"])
    if "rollout/log_probs" in m and "rollout/rollout_log_probs" in m:
        checks["rollout_logprob_abs_diff"] = abs(m["rollout/log_probs"] - m["rollout/rollout_log_probs"])
    if "train/train_rollout_logprob_abs_diff" in m:
        checks["train_rollout_logprob_abs_diff"] = m["train/train_rollout_logprob_abs_diff"]
    if "rollout/entropy" in m:  # Miles' number: the log-prob pass's, a mean of per-sample means
        checks["entropy"] = m["rollout/entropy"]
    elif rollout_id == 0 and "train/step0_entropy" in m:  # megatron without --use-rollout-entropy
        checks["entropy"] = m["train/step0_entropy"]
    log(f"[ci-test] rollout {rollout_id}: {json.dumps(checks)}")
    failures = (
        []
        if cfg.ci_disable_kl_checker
        else _kl_failures(checks, cfg.use_rollout_routing_replay, cfg.uses_lora)
    )
    if not cfg.ci_disable_logprobs_checker:
        failures += _logprob_failures(cfg, checks)
    if failures:
        raise CITestFailure(f"--ci-test at rollout {rollout_id}: {failures[0]}")
    return checks


def _kl_failures(c: dict[str, float], r3: bool, lora: bool) -> list[str]:
    """Miles' check_kl (its kl_loss bound is skipped under R3: the reference does not replay routes;
    its ppo_kl bound is 1e-8 with LoRA, whose weight conversion it allows small differences)."""
    off = " (--ci-disable-kl-checker turns this checker off)"
    kl_loss, kl_tol = c.get("step0_kl_loss", 0.0), 1e-8 if lora else 1e-9
    return [
        msg + off
        for msg, bad in (
            (f"|train/ppo_kl| at step 0 = {c['step0_ppo_kl']:.3g} >= {kl_tol}", c["step0_ppo_kl"] >= kl_tol),
            (f"train/pg_clipfrac at step 0 = {c['step0_pg_clipfrac']:.3g} >= 1e-10", c["step0_pg_clipfrac"] >= 1e-10),
            (f"|train/kl_loss| at step 0 = {kl_loss:.3g} >= 1e-9 (the actor is the reference)",
             kl_loss >= 1e-9 and not r3),
        )
        if bad
    ]  # fmt: skip


def _logprob_failures(cfg: RunConfig, c: dict[str, float]) -> list[str]:
    off = " (--ci-disable-logprobs-checker turns this checker off)"
    tol = R3_REF_LOGPROB_TOL if cfg.use_rollout_routing_replay else REF_LOGPROB_TOL
    bound = cfg.ci_logprob_abs_diff_threshold  # Miles: isclose(abs_tol=0.03), so a diff of 0.03 passes
    nan = float("nan")  # not measured: no check
    ref, diff, ent = (
        c.get(k, nan) for k in ("step0_ref_logprob_abs_diff", "rollout_logprob_abs_diff", "entropy")
    )
    return [
        msg + off
        for msg, bad in (
            (f"trainer vs reference mean log-prob (rollout/log_probs vs rollout/ref_log_probs) differ by "
             f"{ref:.3g} > {tol}", ref > tol),
            (f"trainer vs engine mean log-prob (rollout/log_probs vs rollout/rollout_log_probs) differ by "
             f"{diff:.3g} > {bound} (--ci-logprob-abs-diff-threshold)", diff > bound),
            (f"the trainer's mean entropy (rollout/entropy) = {ent:.3g}, not in (0, {cfg.ci_entropy_max}) "
             "(--ci-entropy-max)", ent == ent and not 0 < ent < cfg.ci_entropy_max),
        )
        if bad
    ]  # fmt: skip


class MetricChecker:
    """Miles' --ci-metric-checker-key / --ci-metric-checker-threshold gate: every eval reports the key;
    at the end of the run at least one of them must have reached the threshold, or with
    --ci-metric-checker-expect-num n exactly n evals ran and every one reached it."""

    def __init__(self, cfg: RunConfig):
        self.key, self.threshold = cfg.ci_metric_checker_key, cfg.ci_metric_checker_threshold
        self.expect_num = cfg.ci_metric_checker_expect_num
        self.seen: list[float] = []

    @classmethod
    def maybe_create(cls, cfg: RunConfig) -> MetricChecker | None:
        return cls(cfg) if cfg.ci_test and cfg.ci_metric_checker_key is not None else None

    def on_eval(self, metrics: dict[str, float], log: Callable[[str], None]) -> None:
        if not metrics:
            return
        if self.key not in metrics:
            keys = sorted(k for k in metrics if k.startswith("eval/"))
            raise CITestFailure(f"--ci-metric-checker-key {self.key}: not among the eval's metrics {keys}")
        value = metrics[self.key]
        self.seen.append(value)
        log(f"[ci-test] metric checker: {self.key} = {value:.4g} (threshold {self.threshold})")

    def dispose(self) -> None:
        if self.expect_num is not None:
            low = [v for v in self.seen if v < self.threshold]
            if len(self.seen) != self.expect_num or low:
                raise CITestFailure(
                    f"--ci-metric-checker-expect-num {self.expect_num}: {len(self.seen)} evals checked "
                    f"{self.key}, {len(low)} below --ci-metric-checker-threshold {self.threshold} "
                    f"(values: {self.seen or 'no eval ran'})"
                )
            return
        if not any(v >= self.threshold for v in self.seen):
            raise CITestFailure(
                f"--ci-metric-checker-key {self.key}: no eval reached --ci-metric-checker-threshold "
                f"{self.threshold} (values: {self.seen or 'no eval ran'})"
            )


def check_weights_equal(cfg: RunConfig, engines, weights, version: int) -> None:
    """Every engine, embedded, external or SGLang, over HTTP (weights/equality.py)."""
    from miles_platform.cluster.devices import run_rollout_dtype
    from miles_platform.weights.equality import first_mismatch

    for e in engines:
        why = first_mismatch(e.url, weights, run_rollout_dtype(cfg), cfg.api_key)
        if why:
            raise CITestFailure(f"--check-weight-update-equal at v{version}: {why}")


def lora_check_on(cfg: RunConfig) -> bool:
    """--check-lora-weight-equal, or any full weight check of a LoRA run (the adapter is the update)."""
    return cfg.syncs_lora_adapter and (cfg.check_lora_weight_equal or weight_check_on(cfg))


def check_lora_weights_equal(cfg: RunConfig, engines, adapter: dict, version: int) -> None:
    """Every engine serves the run's adapter at `version`, each lora_A / lora_B tensor SHA-256-equal
    to the trainer's (cast to the serving dtype), as Miles' --check-lora-weight-equal."""
    from miles_platform.cluster.devices import run_rollout_dtype
    from miles_platform.rollout.base_types import AdapterName
    from miles_platform.rollout.client import EngineHTTPError, post
    from miles_platform.rollout.lora_serving import tensor_sha256
    from miles_platform.training.precision import DTYPES

    name = AdapterName(cfg.run_name).of(version)  # the engine-side name of this version
    dtype = DTYPES[run_rollout_dtype(cfg)]
    want = {k: tensor_sha256(t.to(dtype)) for k, t in adapter.items()}
    for e in engines:
        try:
            got = post(e.url, "/get_lora_adapter_checksums", {"lora_name": name}, api_key=cfg.api_key)
        except EngineHTTPError as err:
            raise CITestFailure(f"--check-lora-weight-equal at v{version}: engine {e.url}: {err}") from err
        if got.get("weight_version") != version:
            raise CITestFailure(
                f"--check-lora-weight-equal at v{version}: engine {e.url} serves the adapter at "
                f"v{got.get('weight_version')}"
            )
        bad = sorted(k for k in set(want) | set(got["sha256"]) if want.get(k) != got["sha256"].get(k))
        if bad:
            raise CITestFailure(
                f"--check-lora-weight-equal at v{version}: engine {e.url}: {len(bad)} adapter tensors differ "
                f"from the trainer's (SHA-256), e.g. {bad[:3]}"
            )


GRAD_NORM_TOL = 0.03  # Miles' check_grad_norm: rel_tol = abs_tol = 0.03


def check_grad_norm(
    cfg: RunConfig, grad_norm: float, rollout_id: int, step_id: int, role: str = "actor"
) -> None:
    """--ci-save-grad-norm / --ci-load-grad-norm (rank 0, every optimizer step, as Miles): the path
    template's {role}, {rollout_id} and {step_id} filled; saved with torch.save (a float: Miles' file,
    so either build's recording compares with the other's), loaded with weights_only."""
    import math

    import torch

    if cfg.ci_save_grad_norm:
        path = cfg.ci_save_grad_norm.format(role=role, rollout_id=rollout_id, step_id=step_id)
        torch.save(float(grad_norm), path)
    elif cfg.ci_load_grad_norm:
        path = cfg.ci_load_grad_norm.format(role=role, rollout_id=rollout_id, step_id=step_id)
        try:
            expected = float(torch.load(path, weights_only=True))
        except FileNotFoundError:
            raise CITestFailure(f"--ci-load-grad-norm: {path} not found (the run that --ci-save-grad-norm'd it "
                                f"did not reach {role} rollout {rollout_id} step {step_id})") from None  # fmt: skip
        if not math.isclose(grad_norm, expected, rel_tol=GRAD_NORM_TOL, abs_tol=GRAD_NORM_TOL):
            raise CITestFailure(
                f"--ci-load-grad-norm: {role} grad norm at rollout {rollout_id} step {step_id} = {grad_norm:.6g}, "
                f"the recording {path} says {expected:.6g} (tolerance {GRAD_NORM_TOL} relative and absolute)"
            )


_LAYER_PATTERNS = (r"(?:^|\.)encoder\.layers\.(\d+)(?:\.|$)", r"(?:^|\.)decoder\.layers\.(\d+)(?:\.|$)",
                   r"(?:^|\.)layers\.(\d+)(?:\.|$)", r"(?:^|\.)layer\.(\d+)(?:\.|$)")  # fmt: skip


def _layer_key(name: str) -> str:
    import re

    for pattern in _LAYER_PATTERNS:
        m = re.search(pattern, name)
        if m:
            return f"layer_{int(m.group(1)):04d}"
    return "non_layer"


def model_hashes_by_layer(chunks) -> dict[str, str]:
    """Miles' compute_model_hashes_by_layer: SHA-256 per layer over each of this rank's parameters'
    name (`pp<chunk>.<name>`), shape, dtype and bytes, in name order; parameters outside a layer
    (embeddings, final norm, head) hash as `non_layer`."""
    import hashlib

    import torch

    hashers: dict[str, hashlib._Hash] = {}
    for pp, chunk in enumerate(chunks):
        for name, p in sorted(chunk.named_parameters(), key=lambda x: x[0]):
            t = p.detach()
            t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard: this rank's part
            full = f"pp{pp}.{name}"
            h = hashers.setdefault(_layer_key(full), hashlib.sha256())
            h.update(full.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(str(p.dtype).encode())
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {k: h.hexdigest() for k, h in sorted(hashers.items())}


def model_hash_file(ckpt_dir: str, ranks: tuple[int, int, int]) -> str:
    """Miles' name: model_hash_tp<t>_pp<p>_dp<d>_cp0.json in the iter dir (context parallel is 1 here)."""
    import os

    tp, pp, dp = ranks
    return os.path.join(ckpt_dir, f"model_hash_tp{tp}_pp{pp}_dp{dp}_cp0.json")


def check_model_hashes(expected_file: str, actual: dict[str, str]) -> None:
    """--ci-check-model-hash after a load: the loaded weights hash as the save recorded, layer by layer."""
    import os

    if not os.path.exists(expected_file):
        raise CITestFailure(
            f"--ci-check-model-hash: {expected_file} missing (save it with --ci-save-model-hash)"
        )
    with open(expected_file) as f:
        expected = json.load(f)
    if actual != expected:
        missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        bad = sorted(k for k in expected.keys() & actual.keys() if expected[k] != actual[k])
        raise CITestFailure(
            f"--ci-check-model-hash: the loaded model differs from {expected_file}: mismatched layers {bad[:5]}, "
            f"missing {missing[:5]}, extra {extra[:5]}"
        )
