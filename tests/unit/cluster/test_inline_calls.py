"""Small objects travel inside Ray calls, not through the raylet's shared-memory store
(cluster/ray_cluster.py `inline_bytes`): a private cluster of ours passes up to 8 MiB inside a call
(an actor's return, an argument), a rollout's train data rides in its handle, and the tensor
transport hands a small model's weights to each engine in its update call. Larger ones still go
through the store, once. On the worker's shared Ray cluster (started by `start_local_ray`)."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch

from miles_platform.cluster import ray_cluster
from miles_platform.cluster.object_store import RayRolloutStore, get_rollout_data
from miles_platform.config import RunConfig

ray = pytest.importorskip("ray")


def plasma_objects() -> int:
    from ray._private.internal_api import memory_summary

    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    return int(re.search(r"Plasma memory usage \d+ MiB, (\d+) objects", summary).group(1))


class Peer:
    def big(self, n: int):
        return np.ones(n, np.uint8)

    def total(self, x) -> int:
        return int(x.sum())

    def receive(self, handle) -> list:
        from miles_platform.cluster.object_store import get_rollout_data

        return get_rollout_data(handle)["tokens"]

    def update_weights_from_tensors(self, data, version: int) -> dict:
        from miles_platform.weights.transports import decode_state

        return {k: v.tolist() for k, v in decode_state(data).items()} | {"version": version}


ray_cloudpickle = pytest.importorskip("ray.cloudpickle")
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def peer():
    ray_cluster.init_ray(RunConfig())  # the worker's shared cluster (tests/conftest.py)
    actor = ray.remote(Peer).options(num_cpus=0).remote()
    yield actor
    ray.kill(actor)


def test_a_private_cluster_passes_megabytes_inside_calls_not_through_the_raylet(peer):
    assert ray_cluster.inline_bytes() == ray_cluster.INLINE_BYTES == 8 << 20
    before = plasma_objects()
    ref = peer.big.remote(2 << 20)  # a return of 2 MiB (the demo model's weights: 1.7 MB)
    x = ray.get(ref)
    assert ray.get(peer.total.remote(x)) == 2 << 20  # and as an argument
    assert plasma_objects() == before  # Ray's 100 KiB default: both in the shared-memory store
    ref = peer.big.remote(9 << 20)  # over the limit: the store, as before
    ray.get(ref)
    assert plasma_objects() == before + 1
    del ref


def test_rollout_data_rides_in_its_handle_unless_over_the_limit(peer, monkeypatch):
    data = {"tokens": [[1, 2, 3]] * 128, "rewards": np.arange(128, dtype=np.float32)}
    store = RayRolloutStore()
    handle = store.put(data)
    assert handle.ref is None and handle.blob is not None  # inside the train call
    assert ray.get(peer.receive.remote(handle)) == data["tokens"]
    assert get_rollout_data(handle)["rewards"].dtype == np.float32
    monkeypatch.setattr(ray_cluster, "inline_bytes", lambda: 1024)
    handle = store.put(data)
    assert handle.blob is None and isinstance(handle.ref, ray.ObjectRef)  # the store, put once
    assert ray.get(peer.receive.remote(handle)) == data["tokens"]
    store.remove(handle)
    assert handle.ref is None and handle.blob is None


def test_tensor_transport_hands_small_weights_inside_each_update_call(peer, tmp_path, monkeypatch):
    from miles_platform.store.paths import StoragePaths
    from miles_platform.weights.transports import EngineHandle
    from miles_platform.weights.transports import tensor as tensor_transport

    state = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(2, dtype=torch.bfloat16),
    }
    want = {"w": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "b": [1.0, 1.0]}
    t = tensor_transport.TensorTransport(RunConfig(), StoragePaths(str(tmp_path)), [EngineHandle("x", peer)])
    for limit, inline in ((8 << 20, True), (1024, False)):
        monkeypatch.setattr(ray_cluster, "inline_bytes", lambda limit=limit: limit)
        stats = t.prepare(state, 3, None)
        assert stats.full_bytes == 6 * 4 + 2 * 2
        assert isinstance(t._ref, dict) is inline and isinstance(t._ref, ray.ObjectRef) is not inline
        ref = t._ref
        assert ray.get(peer.update_weights_from_tensors.remote(ref, 3)) == want | {"version": 3}
        t.activate(3)
        assert t._ref is None
