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
    for s in samples:  # a replay belongs to this run; the source run stays in metadata
        s.metadata = {**s.metadata, "replayed_from_run": s.run}
        s.run, s.rollout_id = cfg.run_name, rollout_id
    return samples
