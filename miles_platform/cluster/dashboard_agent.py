"""Ray's dashboard agent for the private clusters `start_local_ray` starts, without its modules.

The raylet of a node registers it only once the node's dashboard agent is up, and the agent first imports
every module under `ray.dashboard.modules` (reporter, healthz, job, log, event, aggregator, ...) to find
its own: ~1 s and ~1.5 CPU-s of each cluster's start on this project's CPU machines. Each of those modules
serves the dashboard, its API server or a metrics scraper, none of which a private cluster runs
(`ray_cluster._without_monitors`). The agent also runs here in Ray's minimal mode (`--minimal`: no HTTP or
gRPC server; it writes the port files the raylet reads as unused), which alone does not skip the imports.

`python dashboard_agent.py <ray's dashboard/agent.py> ARGS...`: Ray's agent, run as its own script with
its arguments, after `get_all_modules` answers that the agent has no modules.
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    import ray.dashboard.utils as dashboard_utils

    find = dashboard_utils.get_all_modules

    def get_all_modules(module_type):
        return [] if module_type.__name__ == "DashboardAgentModule" else find(module_type)

    dashboard_utils.get_all_modules = get_all_modules
    agent = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(agent, run_name="__main__")


if __name__ == "__main__":
    main()
