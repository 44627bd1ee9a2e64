"""Flags mean what they say: contradictions are refused up front."""

import os

import pytest
from loop_helpers import small_run_kwargs

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.loop import train


def test_debug_train_only_with_nothing_to_load_is_refused_up_front(tiny_hf_checkpoint, tmp_path):
    """No engines and nothing to replay: refused at validation, not a crash on None mid-run."""
    cfg = RunConfig(**small_run_kwargs(tiny_hf_checkpoint, tmp_path, debug_train_only=True))
    with pytest.raises(ConfigError, match="--debug-train-only needs --load-debug-rollout-data"):
        train(cfg)
    assert not os.path.exists(cfg.storage_root)
    with pytest.raises(ConfigError, match="--debug-train-only needs --load-debug-rollout-data"):
        parse_run_config(["--rollout-batch-size", "2", "--debug-train-only"])


@pytest.mark.parametrize("template", ["/tmp/rollouts.parquet", "/tmp/r_{rank}_{rollout_id}.parquet"])
def test_save_debug_rollout_data_template_must_name_each_rollout(template):
    """A template without {rollout_id} would overwrite one file every rollout; a stray field would crash."""
    with pytest.raises(ConfigError, match="--save-debug-rollout-data"):
        parse_run_config(["--rollout-batch-size", "2", "--save-debug-rollout-data", template])
    for ok in ("/tmp/r_{rollout_id}.parquet", "/tmp/r_{rollout_id:06d}.parquet"):
        assert parse_run_config(["--rollout-batch-size", "2", "--save-debug-rollout-data", ok])
