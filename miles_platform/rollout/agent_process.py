"""One agent call in a child process of its own (`--custom-agent-function-mode subproc`).

    python -m miles_platform.rollout.agent_process JOB.json

JOB.json: {path, kwargs: {base_url, prompt, request_kwargs, metadata, ...}, result}. The child
imports the agent function, runs it, and writes {"ok": true, "result": <return value>} or
{"ok": false, "error": "..."} to `result` (temp name, renamed). Arguments and result cross the
process boundary as JSON. SIGTERM cancels the agent, so its `finally` cleanup runs. This module
imports nothing heavy: a child costs an interpreter start plus the agent's own imports.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import sys
import traceback


def _write(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def _run(path: str, kwargs: dict):
    module, _, name = path.rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    task = asyncio.ensure_future(fn(**kwargs))
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


def main(job_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = asyncio.run(_run(job["path"], job["kwargs"]))
    except BaseException as e:  # noqa: BLE001 - everything the agent raises is its sample's failure
        tb = traceback.format_exc(limit=-3)
        _write(job["result"], {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": tb})
        return 1
    try:
        json.dumps(result)
    except (TypeError, ValueError) as e:
        _write(job["result"], {"ok": False, "error": f"the agent returned a value that is not JSON: {e}"})
        return 1
    _write(job["result"], {"ok": True, "result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
