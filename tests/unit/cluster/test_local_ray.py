"""The private one-node Ray cluster a driver starts (cluster/ray_cluster.py) runs no log monitor, no
autoscaler monitor and no dashboard API server: every driver of ours connects with log_to_driver=False, so the log monitor
streamed to no one while its polling grew with each actor's log files (27 CPU-s over a `make test`,
2026-12-06), and the autoscaler monitor has nothing to scale on one node and did not answer
SIGTERM (Ray's shutdown waited out a 1 s grace for it at the end of every local run); the API
server served Ray's job and state APIs on a port no one is told of. Its dashboard agent runs minimal and
loads no modules (they serve the dashboard and its API server), and the raylet waits for that agent."""

import time

import psutil
import pytest

pytestmark = [pytest.mark.own_ray, pytest.mark.slow]  # a Ray start of its own


def test_a_private_cluster_runs_no_monitor_nor_api_server_and_stops_without_a_grace_wait():
    import ray
    from ray._private import ray_constants
    from ray._private import worker as ray_worker

    from miles_platform.cluster.ray_cluster import RayContext, shutdown_ray, start_local_ray

    start_local_ray(2)
    try:
        node = ray_worker._global_node
        started = {k for k, v in node.all_processes.items() if v}
        assert (
            ray_constants.PROCESS_TYPE_GCS_SERVER in started and ray_constants.PROCESS_TYPE_RAYLET in started
        )
        assert ray_constants.PROCESS_TYPE_LOG_MONITOR not in started
        assert ray_constants.PROCESS_TYPE_MONITOR not in started
        assert ray_constants.PROCESS_TYPE_DASHBOARD not in started
        # and none on the machine either: no process of this session's dir runs either script
        session = node.get_session_dir_path()
        scripts = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
        ours = [c for c in scripts if session in c]
        assert ours and not [
            c for c in ours if "log_monitor.py" in c or "autoscaler/_private/monitor.py" in c
        ]
        # its dashboard agent: Ray's, minimal, through our launcher (cluster/dashboard_agent.py: no modules)
        agent = [c.split() for c in ours if "dashboard/agent.py" in c]
        assert len(agent) == 1 and "--minimal" in agent[0], agent
        assert any(a.endswith("miles_platform/cluster/dashboard_agent.py") for a in agent[0]), agent
        assert ray.get(ray.remote(lambda: 7).remote(), timeout=60) == 7  # and the cluster works
    finally:
        t0 = time.monotonic()
        shutdown_ray(RayContext(address=None, started_local=True, connected=True))
    assert time.monotonic() - t0 < 1.0 and not ray.is_initialized()
    # the switches were for that start only: the next head node gets Ray's defaults again
    from ray._private import node as ray_node

    assert ray_node.Node.__init__.__qualname__ == "Node.__init__"
    assert ray_node.Node.start_api_server.__qualname__ == "Node.start_api_server"
    from ray._private import services
    from ray._private import utils as ray_utils

    assert ray_utils.get_dashboard_dependency_error.__qualname__ == "get_dashboard_dependency_error"
    assert services._build_python_executable_command_memory_profileable.__module__ == "ray._private.services"
