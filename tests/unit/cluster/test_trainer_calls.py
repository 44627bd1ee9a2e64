"""A hung trainer rank must not hang the run (issue #49, item 10): every call on the trainer ranks
is bounded by --train-timeout-s and names the ranks that did not answer."""

from __future__ import annotations

import time

import pytest

from miles_platform.config import RunConfig
from miles_platform.errors import ActorDied
from miles_platform.run_services import call_trainers


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from miles_platform.cluster.ray_cluster import init_ray, shutdown_ray

    ctx = init_ray(RunConfig(rollout_batch_size=1))
    yield ray
    shutdown_ray(ctx)


@pytest.mark.slow  # a local Ray start
def test_a_rank_that_does_not_answer_stops_the_run_by_name(ray_local, tmp_path):
    class SlowRank:  # local: Ray pickles it by value (the test module is not importable in a worker)
        def __init__(self, delay: float):
            self.delay = delay

        def train(self, rollout_id: int) -> dict:
            time.sleep(self.delay)  # a SIGSTOPped rank never answers; a long sleep stands in for it
            return {"rollout": rollout_id}

        def ready(self) -> bool:
            return True

    ranks = [ray_local.remote(num_cpus=0)(SlowRank).remote(d) for d in (0.0, 600.0)]
    ray_local.get([r.ready.remote() for r in ranks])  # started: the bound is about the call alone
    cfg = RunConfig(rollout_batch_size=1, run_name="mine", save=str(tmp_path), train_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(
        ActorDied,
        match=r"trainer rank\(s\) \[1\] of run 'mine' did not finish train within 2 s \(--train-timeout-s\)",
    ):
        call_trainers(cfg, ranks, "train", 3)
    assert time.monotonic() - t0 < 30  # without the bound: forever
    assert call_trainers(cfg, ranks[:1], "train", 4) == {"rollout": 4}
