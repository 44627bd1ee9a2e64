"""Rollout-data handoff: Ray object store and a real Mooncake Store over TCP on loopback.

Mooncake: `mooncake_master` from mooncake-transfer-engine-non-cuda runs as a subprocess; the
writer (this process) contributes a segment, the "trainer" is a Ray actor in another process that
joins as a 0-segment client and reads over the TCP transfer engine.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import pytest

from miles_platform.cluster.object_store import (
    decode_rollout_data,
    encode_rollout_data,
    get_rollout_data,
    get_store,
    parse_size,
    put_rollout_data,
    resolve_mooncake_kwargs,
    store_from_config,
)
from miles_platform.config import ConfigError, RunConfig

pytestmark = pytest.mark.own_ray  # starts, joins and stops Ray itself


def rollout_batch() -> dict:
    rng = np.random.default_rng(0)
    return {
        "tokens": rng.integers(0, 32000, size=(8, 64), dtype=np.int64),
        "rollout_log_probs": rng.standard_normal((8, 64)).astype(np.float32),
        "loss_masks": np.ones((8, 64), dtype=np.bool_),
        "rewards": [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25],
        "response_lengths": [64] * 8,
        "status": ["completed"] * 7 + ["truncated"],
        "metadata": {"rollout_id": 3, "run": "r"},
    }


def digest(data: dict) -> str:
    """Order-, dtype- and shape-sensitive fingerprint the trainer computes on what it received."""
    h = hashlib.sha256()
    for k in sorted(data):
        v = data[k]
        if isinstance(v, np.ndarray):
            h.update(f"{k}:{v.dtype.str}:{v.shape}".encode() + v.tobytes())
        else:
            h.update(f"{k}:{json.dumps(v, sort_keys=True)}".encode())
    return h.hexdigest()


class Trainer:
    def receive(self, handle) -> str:
        from miles_platform.cluster.object_store import get_rollout_data

        return digest(get_rollout_data(handle))


ray_cloudpickle = pytest.importorskip("ray.cloudpickle")
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_encoding_round_trip_without_pickle():
    data = rollout_batch()
    back = decode_rollout_data(encode_rollout_data(data))
    assert digest(back) == digest(data)
    assert back["tokens"].dtype == np.int64 and back["loss_masks"].dtype == np.bool_
    with pytest.raises(TypeError, match="'bad'"):
        encode_rollout_data({"bad": object()})


def test_mooncake_kwargs_flag_over_env_over_default():
    env = {
        "MOONCAKE_MASTER": "10.0.0.1:50051",
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_LOCAL_BUFFER_SIZE": "1gb",
    }
    kw = resolve_mooncake_kwargs(
        '{"master_server_address": "10.0.0.9:50051", "global_segment_size": "2gb"}', env
    )
    assert kw["master_server_address"] == "10.0.0.9:50051"  # flag wins
    assert kw["protocol"] == "tcp" and kw["local_buffer_size"] == 1024**3  # env
    assert kw["metadata_server"] == "P2PHANDSHAKE" and kw["global_segment_size"] == 2 * 1024**3
    assert resolve_mooncake_kwargs(None, {"MOONCAKE_MASTER": "h:1"})["protocol"] == "rdma"  # Miles default
    with pytest.raises(ConfigError, match="MOONCAKE_MASTER"):
        resolve_mooncake_kwargs(None, {})
    with pytest.raises(ConfigError, match="unknown fields"):
        resolve_mooncake_kwargs('{"master": "x"}', {})
    assert parse_size("512mb") == 512 * 1024**2 and parse_size(7) == 7


def test_trainer_receives_same_rollout_data_on_both_backends(mooncake_master, monkeypatch):
    import ray

    from miles_platform.cluster.ray_cluster import init_ray, shutdown_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    data, expected = rollout_batch(), digest(rollout_batch())
    flag = json.dumps(
        {
            "protocol": "tcp",
            "master_server_address": mooncake_master,
            "local_hostname": "127.0.0.1",
            "global_segment_size": "64mb",
            "local_buffer_size": "64mb",
        }
    )
    ctx = init_ray(RunConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1))
    try:
        trainer = (
            ray.remote(Trainer)
            .options(num_cpus=0, runtime_env={"env_vars": {"MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"}})
            .remote()
        )
        got = {}
        for backend in ("ray", "mooncake"):
            cfg = RunConfig(object_store_backend=backend, mooncake_store_init_kwargs=flag)
            handle = put_rollout_data(data, store_from_config(cfg))
            assert handle.backend == backend
            assert digest(get_rollout_data(handle)) == expected  # same process
            got[backend] = ray.get(trainer.receive.remote(handle), timeout=60)  # another process
        assert got == {"ray": expected, "mooncake": expected}
        store = get_store("mooncake", resolve_mooncake_kwargs(flag))
        store.remove(handle)
        with pytest.raises(KeyError, match=handle.key):
            get_rollout_data(handle)
    finally:
        shutdown_ray(ctx)
