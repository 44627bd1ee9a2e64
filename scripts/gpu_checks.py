"""GPU evidence: run the checks in tests/gpu (pytest, `gpu` marker) and write one JSON report.

    python scripts/gpu_checks.py --out DIR        (or scripts/gpu_checks.sh DIR on a bare GPU machine)

On a lent H200 (docs/scale_out.md "On one GPU": which wheels to carry in .whl/ and why), one call:
    run(command="bash scripts/gpu_checks.sh $OUT --deadline 540", carry=[".whl"], timeout_s=600)

The checks are ordinary pytest files (tests/gpu/test_{trainer,engine,grpo_run,megatron,
megatron_fp16_offload,fsdp,kernels}_gpu.py:
the loop's trainer and the embedded engine on the device against the CPU, the demo's GRPO run on one
GPU separate and colocated through tests/gpu/ray_free_grpo.py, which needs no Ray; megatron's --fp16
loss scaling and --optimizer-cpu-offload's host placement, with --use-precision-aware-optimizer too,
with the trainer on the GPU); this script runs `pytest tests/gpu -m gpu` in a subprocess with itself
as a plugin (`-p gpu_checks`),
which rewrites DIR/gpu_checks.json after every test: {"cuda", "device_name", "env", "checks":
{test id: {"status", "duration_s", ...what the test recorded}}, "summary", "all_judged_pass"}.
Status is "pass", "fail", "error" (a fixture failed) or "skipped" (with its reason). DIR/gpu_checks.log
holds pytest's output. MILES_GPU_CHECKS_ON_CPU=1 is set, so without CUDA the same checks run on
the CPU (`ran_on_cuda` false in each); only a report with `"cuda": true` is GPU evidence.
Exit status 0 when every judged test passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT_ENV = "MILES_GPU_CHECKS_REPORT"  # where the plugin (in the pytest process) writes
# the one-GPU smoke run has its own script (scripts/gpu_smoke.sh) and takes half an hour
NOT_CHECKS = ["tests/gpu/test_cluster_gpu_smoke.py"]


def environment() -> dict:
    """torch / CUDA / megatron-core / transformers versions, TF32 flags, transformer-engine."""
    import platform

    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(
            device_name=p.name,
            capability=f"{p.major}.{p.minor}",
            total_mem_gib=round(p.total_memory / 2**30, 1),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
        )
    for mod in ("transformers", "safetensors", "megatron.core", "numpy", "transformer_engine"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = f"{getattr(m, '__version__', '?')} ({Path(m.__file__).parent})"
        except Exception as e:  # noqa: BLE001 - recorded, not judged
            out[mod] = f"not importable: {type(e).__name__}: {str(e)[:200]}"
    return out


# ------------------------------------------------------------------- the plugin (pytest process)


class Report:
    """Collects each test's outcome and `record_property` values; rewrites the JSON atomically."""

    def __init__(self, path: Path):
        self.path = path
        env = environment()
        self.data = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "cuda": env["cuda_available"],
                     "device_name": env.get("device_name"), "env": env, "checks": {}}  # fmt: skip
        self.write()

    def pytest_runtest_logreport(self, report) -> None:
        c = self.data["checks"].setdefault(report.nodeid, {"status": "pass", "duration_s": 0.0})
        c["duration_s"] = round(c["duration_s"] + report.duration, 2)
        c.update(dict(report.user_properties))
        if report.skipped:
            c["status"] = "skipped"
            c["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        elif report.failed:
            c["status"] = "fail" if report.when == "call" else "error"
            c.setdefault("failure", report.longreprtext[-4000:])
        if report.when == "teardown":
            self.write()

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.data["pytest_exit_status"] = int(exitstatus)
        self.write()

    def write(self) -> None:
        c = self.data["checks"]
        self.data["summary"] = {k: v["status"] for k, v in c.items()}
        judged = [v["status"] for v in c.values() if v["status"] != "skipped"]
        self.data["all_judged_pass"] = bool(judged) and all(s == "pass" for s in judged)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def pytest_configure(config) -> None:
    if os.environ.get(REPORT_ENV) and not hasattr(config, "workerinput"):  # xdist: the controller writes
        config.pluginmanager.register(Report(Path(os.environ[REPORT_ENV])), "gpu_checks_report")


# -------------------------------------------------------------------------------- the runner


def checks_command(work: Path, only: str, jobs: int) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-p", "gpu_checks", "-p", "no:cacheprovider",
           "-rA", "--basetemp", str(work / "pytest")]  # fmt: skip
    cmd += [f"--ignore={p}" for p in NOT_CHECKS]
    if only:
        cmd += ["-k", " or ".join(n for n in only.split(",") if n)]
    if jobs > 1 and importlib.util.find_spec(
        "xdist"
    ):  # one file per worker: its own process and CUDA context
        cmd += ["-n", str(jobs), "--dist", "loadfile"]
    return cmd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, required=True, help="report directory (gpu_checks.json, gpu_checks.log)"
    )
    ap.add_argument("--work", type=Path, help="scratch directory (default: a new temp dir)")
    ap.add_argument("--only", default="", help="comma-separated pytest -k terms, e.g. kernels,fsdp2")
    ap.add_argument("--jobs", type=int, default=0, help="pytest-xdist workers (default: 4 with CUDA, else 2)")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole run")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.work or Path(tempfile.mkdtemp(prefix="gpu_checks_"))
    work.mkdir(parents=True, exist_ok=True)
    jobs = a.jobs or (4 if Path("/dev/nvidia0").exists() or os.environ.get("CUDA_VISIBLE_DEVICES") else 2)
    report = a.out / "gpu_checks.json"
    path = [str(REPO), str(REPO / "scripts")] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
    ]
    env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1", MILES_GPU_CHECKS_ON_CPU="1", PYTHONPATH=os.pathsep.join(path),
               **{REPORT_ENV: str(report)})  # fmt: skip
    cmd = checks_command(work, a.only, jobs)
    with open(a.out / "gpu_checks.log", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=a.deadline)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest, its workers and what they started
            rc = proc.wait()
    data = json.loads(report.read_text()) if report.exists() else {"checks": {}, "all_judged_pass": False}
    data["cmd"] = " ".join(cmd[1:])
    if rc not in (0, 1, 5) or "finished" not in data:  # 1: tests failed (judged); 5: none collected
        data["error"] = f"pytest did not finish (rc={rc}, deadline {a.deadline:.0f} s): see gpu_checks.log"
        data["all_judged_pass"] = False
    tmp = report.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(report)
    print(json.dumps(data.get("summary", {}), indent=1))
    return 0 if data["all_judged_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
