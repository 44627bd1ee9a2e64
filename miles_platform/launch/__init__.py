"""Where a run runs: submitted to a Ray cluster as a Ray job (`ray_jobs.py`: `train --submit`, the
`rl_training` op's `launcher: ray_job`) and the job's driver on the cluster (`job_driver.py`).
Above the loop: it validates (preflight) and trains (loop) as `miles-platform train` does."""
