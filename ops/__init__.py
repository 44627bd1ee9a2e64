"""Dagster ops and jobs: the Ray-hosted training job."""


def all_jobs():
    try:
        from ops.training import rl_training
    except ModuleNotFoundError as e:
        if e.name != "ops.training":
            raise
        return []
    return [rl_training]
