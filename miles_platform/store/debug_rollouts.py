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
    import pyarrow.parquet as pq

    from miles_platform.data.sample import Sample

    path = cfg.load_debug_rollout_data.format(rollout_id=rollout_id)
    if not os.path.exists(path):
        raise ConfigError(f"--load-debug-rollout-data: {path} not found for rollout {rollout_id}")
    samples = [Sample.from_row(r) for r in pq.read_table(path).to_pylist()]
    if cfg.load_debug_rollout_data_subsample is not None:
        samples = subsample(cfg, samples, rollout_id)
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
