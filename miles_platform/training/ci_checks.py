"""--ci-test and --check-weight-update-equal, as in Miles: at step 0 the trainer's policy is the
engine's, so PPO's KL and clip fraction are 0 and the two log-probs agree; after every update the
engines hold exactly the trainer's weights (over HTTP, for embedded, external and SGLang engines)."""

from __future__ import annotations

import json
from collections.abc import Callable

from miles_platform.config import RunConfig
from miles_platform.run_types import CITestFailure


def weight_check_on(cfg: RunConfig) -> bool:
    """--check-weight-update-equal, or --ci-test unless --ci-disable-weight-update-checker (as Miles)."""
    return cfg.check_weight_update_equal or (cfg.ci_test and not cfg.ci_disable_weight_update_checker)


def step0_checks(cfg: RunConfig, m: dict[str, float], log: Callable[[str], None]) -> dict[str, float]:
    checks = {
        "step0_ppo_kl": abs(m.get("train/step0_ppo_kl", 0.0)),
        "step0_pg_clipfrac": m.get("train/step0_pg_clipfrac", 0.0),
        "train_rollout_logprob_abs_diff": m.get("train/train_rollout_logprob_abs_diff", 0.0),
    }
    log(f"[ci-test] rollout 0: {json.dumps(checks)}")
    if checks["step0_ppo_kl"] >= 1e-9:
        raise CITestFailure(f"--ci-test: |train/ppo_kl| at step 0 = {checks['step0_ppo_kl']:.3g} >= 1e-9")
    if checks["step0_pg_clipfrac"] >= 1e-10:
        raise CITestFailure(
            f"--ci-test: train/pg_clipfrac at step 0 = {checks['step0_pg_clipfrac']:.3g} >= 1e-10"
        )
    diff = checks["train_rollout_logprob_abs_diff"]
    if not cfg.use_rollout_logprobs and diff >= cfg.ci_logprob_abs_diff_threshold:
        raise CITestFailure(
            f"--ci-test: trainer-vs-engine log-prob abs diff {diff:.3g} >= {cfg.ci_logprob_abs_diff_threshold}"
        )
    return checks


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
