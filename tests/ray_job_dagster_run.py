"""Runs the `rl_training` job with `launcher: ray_job` in this process against the Dagster instance
of $DAGSTER_HOME (tests/e2e/test_cluster_ray.py kills or interrupts this process mid-run).

usage: ray_job_dagster_run.py CONFIG_JSON STORAGE_ROOT
"""

import json
import sys

import dagster as dg

from ops.training import rl_training
from resources.storage import StorageRootResource


def main() -> int:
    config, root = json.loads(sys.argv[1]), sys.argv[2]
    result = rl_training.execute_in_process(
        run_config={"ops": {"rl_training_op": {"config": config}}},
        instance=dg.DagsterInstance.get(),
        resources={"storage": StorageRootResource(root=root)},
        raise_on_error=False,
    )
    print("RUN_SUCCESS" if result.success else "RUN_FAILED", flush=True)
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main())
