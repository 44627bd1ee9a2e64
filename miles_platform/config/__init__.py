"""Run configuration by capability. Each module owns one capability's flags (a dataclass of fields
with Miles' names, defaults, help and ranges) and its checks; `run_config.RunConfig` flattens them
into the one dataclass the CLI (`cli.py`), YAML files and the Dagster Launchpad read; `flags.py` is
the flag machinery `train-diffusion` shares.

  flags.py            flag(), flag_name, field_default, changed_flags, ranges, add_flag, load_yaml
  cluster.py          Ray, trainer ranks, engines, router, fault tolerance, the run secret
  checkpoint.py       backend, HF checkpoint, reference, save / load, seeds
  rollout.py          prompt data and batching, rollout / generate functions, sampling, fully async
  agentic.py          multi-turn tool calls, agent functions, the TITO session server
  reward.py           rm_hub reward or a custom one, reward keys, filters; RewardSettings
  evaluation.py       eval datasets, interval and sampling (inherits rollout sampling); EvalSettings
  algorithm.py        loss, estimator, KL, clipping, TIS / MIS / OPSM, the PPO critic
  model_args.py       megatron's model flags (a Miles script's MODEL_ARGS), checked against the checkpoint
  moe.py              routing replay (R3) and the --moe-* flags
  megatron.py         megatron layout beyond the sizes, weight-update buckets, --bf16, recompute
  score_centering.py  --loss-type score_centering
  opd.py              on-policy distillation, the teacher routing map
  training.py         optimizer, micro-batching and parallelism, precision
  weights.py          weight-update transport, disk-delta, pause mode
  lora.py             LoRA adapters
  outputs.py          storage root, run name, experiment trackers
  debug.py            debug and CI switches, fault hooks
  run_config.py       RunConfig, validate(), config_hash, REFUSED, RESUMABLE
  cli.py              the argparse parser, YAML, passthrough and function flags
"""

from miles_platform.config.algorithm import MIS_FLAGS
from miles_platform.config.checkpoint import check_seeds
from miles_platform.config.cli import add_flags, build_parser, function_flag_values, parse_run_config
from miles_platform.config.evaluation import EvalSettings
from miles_platform.config.flags import load_yaml
from miles_platform.config.lora import LORA_FLAGS
from miles_platform.config.model_args import MODEL_ARGS
from miles_platform.config.opd import OPD_REWARD_WEIGHT_MODES, OPD_TOP_K_STRATEGIES, OPD_TYPES
from miles_platform.config.outputs import RUN_NAME, WANDB_MODES, check_run_name
from miles_platform.config.reward import REWARD_FLAGS, RewardSettings
from miles_platform.config.rollout import DATASET_FLAGS, derive_batch_knobs
from miles_platform.config.run_config import (
    GROUPS,
    LOGGING,
    REFUSED,
    RESUMABLE,
    RunConfig,
    config_changes,
    saved_config,
)
from miles_platform.config.weights import ALIASES
from miles_platform.errors import ConfigError, MilesError

__all__ = [
    "ALIASES",
    "DATASET_FLAGS",
    "GROUPS",
    "LOGGING",
    "LORA_FLAGS",
    "MODEL_ARGS",
    "MIS_FLAGS",
    "OPD_REWARD_WEIGHT_MODES",
    "OPD_TOP_K_STRATEGIES",
    "OPD_TYPES",
    "REFUSED",
    "RESUMABLE",
    "REWARD_FLAGS",
    "RUN_NAME",
    "WANDB_MODES",
    "ConfigError",
    "EvalSettings",
    "MilesError",
    "RewardSettings",
    "RunConfig",
    "add_flags",
    "build_parser",
    "check_run_name",
    "check_seeds",
    "config_changes",
    "derive_batch_knobs",
    "function_flag_values",
    "load_yaml",
    "parse_run_config",
    "saved_config",
]
