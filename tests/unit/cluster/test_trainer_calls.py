"""A hung trainer rank must not hang the run (issue #49, item 10): every call on the trainer ranks
is bounded by --train-timeout-s and names the ranks that did not answer."""

from __future__ import annotations

import time

import pytest

from miles_platform.config import RunConfig
from miles_platform.errors import ActorDied, ConfigError
from miles_platform.run_services import call_trainers


@pytest.fixture
def ray_local():
    """The worker's shared Ray (conftest), started if it is not up yet, and left running."""
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


class _Rank:  # module level: the same class each run, as the trainer's and engine's are
    def __init__(self, rank: int):
        self.rank = rank

    def ready(self) -> int:
        return self.rank


@pytest.mark.slow  # a local Ray start
def test_an_actor_class_is_exported_to_the_cluster_once_per_process_not_per_run(ray_local, monkeypatch):
    """Ray fingerprints and exports an actor class the first time its wrapper creates an actor (~0.2
    CPU-s of the driver for the trainer's): a second run in the same process (the Dagster op's, a
    test worker's) creates its actors from the same wrapper and exports nothing again."""
    import sys

    from ray import cloudpickle
    from ray._private.function_manager import FunctionActorManager

    from miles_platform.cluster.ray_cluster import (
        create_placement_groups,
        create_role_actors,
        remove_placement_groups,
    )

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import a test module
    exports = []
    real = FunctionActorManager.export_actor_class
    monkeypatch.setattr(FunctionActorManager, "export_actor_class",
                        lambda self, cls, *a: (exports.append(cls.__name__), real(self, cls, *a))[1])  # fmt: skip
    cfg = RunConfig(rollout_batch_size=1)
    for _ in range(2):  # two runs
        groups = create_placement_groups(cfg, use_gpu=False)
        ranks = create_role_actors(_Rank, cfg, groups, "actor")
        assert ray_local.get([r.ready.remote() for r in ranks], timeout=60) == [0]
        for r in ranks:
            ray_local.kill(r)
        remove_placement_groups(groups)
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert exports == ["_Rank"]


def test_trainer_threads_one_unless_told(monkeypatch):
    """One torch thread a trainer rank unless $MILES_TRAIN_THREADS says; a bad value is refused."""
    from miles_platform.cluster.cpu_pinning import trainer_threads

    monkeypatch.delenv("MILES_TRAIN_THREADS", raising=False)
    assert trainer_threads() == "1"
    monkeypatch.setenv("MILES_TRAIN_THREADS", "3")
    assert trainer_threads() == "3"
    for bad in ("two", "0", "-1"):
        monkeypatch.setenv("MILES_TRAIN_THREADS", bad)
        with pytest.raises(ConfigError, match=f"MILES_TRAIN_THREADS='{bad}'"):
            trainer_threads()
