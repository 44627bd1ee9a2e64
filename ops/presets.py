"""Launchpad presets of the `rl_training` op: each one a job of its own (`rl_training_<name>`), listed
and described in the UI's jobs, its Launchpad filled with the preset's config (any field editable).

A job, not a partition of `rl_training`: a picked partition stays on the Launchpad session as a
`dagster/partition` tag, so a config typed afterwards ran tagged as the preset. Paths are left to
the latest `prompt_dataset` / `base_checkpoint`. Each preset's run is named `<name>-{run_id}`:
the op puts the first 8 characters of the Dagster run's id there, so each launch trains a fresh
run and a re-execution (same root run) resumes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import dagster as dg

RUN_ID = "{run_id}"  # in a Launchpad run_name: the Dagster run's id (its first attempt's), 8 characters

SMOKE_RL = dict(
    rm_type="math", input_key="prompt", label_key="label", rollout_batch_size=2, n_samples_per_prompt=2,
    num_rollout=2, rollout_max_response_len=4, lr=1e-4, save_interval=2,
)  # fmt: skip


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: dict[str, Any]  # rl_training_op's config

    @property
    def job_name(self) -> str:
        return f"rl_training_{self.name}"


def presets() -> list[Preset]:
    from miles_platform.recipes import DEMO_RL

    return [
        Preset("demo", "Preset of rl_training: the quickstart's GRPO recipe on the arithmetic task (DEMO_RL: "
               "100 rollouts of 16 prompts x 8 samples, eval every 10th version), from the latest "
               "prompt_dataset and base_checkpoint. Edit any field in the Launchpad before launching.",
               dict(DEMO_RL, num_rollout=100, run_name=f"demo-{RUN_ID}")),
        Preset("smoke", "Preset of rl_training: a smoke run, 2 rollouts of 2 prompts x 2 samples, 4 tokens "
               "(seconds once Ray is up), from the latest prompt_dataset and base_checkpoint. Edit any "
               "field in the Launchpad before launching.",
               dict(SMOKE_RL, run_name=f"smoke-{RUN_ID}")),
    ]  # fmt: skip


def run_name_for(run_name: str, run: dg.DagsterRun) -> str:
    """`{run_id}` in a Launchpad run_name -> the first 8 characters of the Dagster run's id; for a
    re-execution, of its root run's, so it resumes the run its first attempt trained."""
    return run_name.replace(RUN_ID, (run.root_run_id or run.run_id)[:8])
