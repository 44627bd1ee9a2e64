"""Dagster ops and jobs: the Ray-hosted training jobs (LLM RL and diffusion RL) and the named
asset jobs of the campaign's other steps (ops/asset_jobs.py)."""


def all_jobs():
    from ops.asset_jobs import ASSET_JOBS
    from ops.diffusion import diffusion_training
    from ops.training import PRESET_JOBS, rl_training

    return [rl_training, *PRESET_JOBS.values(), diffusion_training, *ASSET_JOBS]
