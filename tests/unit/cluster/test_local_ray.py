"""The private one-node Ray cluster a driver starts (cluster/ray_cluster.py): stopping it does not wait
on its autoscaler monitor, which does not answer SIGTERM (Ray's shutdown waited out a 1 s grace for
it at the end of every local run: 1.02 of 1.44 s, measured 2026-12-06)."""

import pytest

pytestmark = [pytest.mark.own_ray, pytest.mark.slow]  # a Ray start of its own


def test_stopping_a_private_cluster_kills_its_autoscaler_monitor_first(monkeypatch):
    from ray._private import node as ray_node
    from ray._private import ray_constants

    from miles_platform.cluster.ray_cluster import RayContext, shutdown_ray, start_local_ray

    monitor = ray_constants.PROCESS_TYPE_MONITOR
    seen = []
    real = ray_node.Node._kill_process_type

    def record(self, process_type, *a, **kw):
        if process_type == monitor:  # what Ray finds when it comes to stop the monitor
            seen.append([i.process.poll() is None for i in self.all_processes.get(monitor, [])])
        return real(self, process_type, *a, **kw)

    monkeypatch.setattr(ray_node.Node, "_kill_process_type", record)
    start_local_ray(2)
    shutdown_ray(RayContext(address=None, started_local=True, connected=True))
    assert seen == [[False]]  # one monitor, already gone: no SIGTERM grace to wait out
