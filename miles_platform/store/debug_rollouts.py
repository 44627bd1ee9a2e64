"""--save-debug-rollout-data / --load-debug-rollout-data: one Parquet file of Samples per rollout
(path template with {rollout_id}), written atomically; a replay re-homes them to this run."""

from __future__ import annotations

import os

from miles_platform.config import ConfigError, RunConfig


def save_debug_rollout(cfg: RunConfig, rollout_id: int, samples) -> None:
    from miles_platform.store.shards import samples_to_table, write_parquet_atomic

    path = cfg.save_debug_rollout_data.format(rollout_id=rollout_id)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_parquet_atomic(samples_to_table(samples), path)


def load_debug_rollout(cfg: RunConfig, rollout_id: int):
    samples = _read(cfg, "--load-debug-rollout-data", cfg.load_debug_rollout_data, rollout_id)
    if cfg.load_debug_rollout_data_subsample is not None:
        samples = subsample(cfg, samples, rollout_id)
    return samples


def _read(cfg: RunConfig, flag: str, template: str, rollout_id: int) -> list:
    """A recorded rollout (--save-debug-rollout-data's Parquet), re-homed to this run and rollout."""
    import pyarrow.parquet as pq

    from miles_platform.data.sample import Sample

    path = template.format(rollout_id=rollout_id)
    if not os.path.exists(path):
        raise ConfigError(f"{flag}: {path} not found for rollout {rollout_id}")
    samples = [Sample.from_row(r) for r in pq.read_table(path).to_pylist()]
    for s in samples:  # a replay belongs to this run; the source run stays in metadata
        s.metadata = {**s.metadata, "replayed_from_run": s.run}
        s.run, s.rollout_id = cfg.run_name, rollout_id
    return samples


def subsample(cfg: RunConfig, samples: list, rollout_id: int) -> list:
    """--load-debug-rollout-data-subsample r: as Miles, int(r * rows) rows taken half from the start
    and half from the end of the rollout, in whole prompt groups here (GRPO normalizes over a group);
    the run's batch knobs must describe what is kept."""
    n = cfg.n_samples_per_prompt
    groups = [samples[i : i + n] for i in range(0, len(samples), n)]
    k = int(len(groups) * cfg.load_debug_rollout_data_subsample)
    kept = groups[: k - k // 2] + (groups[len(groups) - k // 2 :] if k // 2 else [])
    if len(kept) != cfg.rollout_batch_size:
        raise ConfigError(
            f"--load-debug-rollout-data-subsample {cfg.load_debug_rollout_data_subsample}: keeps {len(kept)} of the "
            f"{len(groups)} prompt groups of rollout {rollout_id}; set --rollout-batch-size {len(kept)} (and "
            "--global-batch-size to fit) to train on them"
        )
    return [s for g in kept for s in g]


def inject_rollout(cfg: RunConfig, rollout_id: int, generated: list) -> tuple[list, float]:
    """--ci-inject-rollout-data-path (Miles' CI comparison): from --ci-inject-rollout-data-start-rollout-id
    on, the rollout still generates, its samples are compared with the recording and discarded, and the
    recording is trained on. The mean response-token match ratio (per sample: equal tokens at equal
    positions over the longer response) must exceed --ci-inject-rollout-data-min-match-ratio, else the
    engines hold other weights than the recording's run: CITestFailure. -> (samples, mean ratio)."""
    from miles_platform.run_types import CITestFailure

    flag = "--ci-inject-rollout-data-path"
    injected = _read(cfg, flag, cfg.ci_inject_rollout_data_path, rollout_id)
    if len(injected) != len(generated):
        raise CITestFailure(
            f"{flag}: rollout {rollout_id}: {len(generated)} samples generated, {len(injected)} recorded"
        )
    ratios = []
    for k, (g, r) in enumerate(zip(generated, injected, strict=True)):
        if list(g.prompt_tokens) != list(r.prompt_tokens):
            raise CITestFailure(
                f"{flag}: rollout {rollout_id}: prompt tokens differ at sample {k}; the recording does not "
                "pair with the generated batch (same data, seed and --rollout-batch-size?)"
            )
        a, b = list(g.response_tokens), list(r.response_tokens)
        ratios.append(
            sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), len(b)) if a or b else 1.0
        )
    mean = sum(ratios) / max(len(ratios), 1)
    if not mean > cfg.ci_inject_rollout_data_min_match_ratio:
        raise CITestFailure(
            f"{flag}: rollout {rollout_id}: generated responses match the recording at {mean:.4f} (threshold "
            f"--ci-inject-rollout-data-min-match-ratio {cfg.ci_inject_rollout_data_min_match_ratio}): the engines' "
            "weights diverged from the recorded run beyond ulp-level drift"
        )
    return injected, mean
