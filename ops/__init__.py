"""Dagster ops and jobs: the Ray-hosted training jobs (LLM RL and diffusion RL)."""


def all_jobs():
    from ops.diffusion import diffusion_training
    from ops.training import rl_training

    return [rl_training, diffusion_training]
