"""SGLang launcher: the command Miles would run, a real Ray actor owning a real server process,
and the external-attach path against a real HTTP server on loopback.

`sglang` itself needs CUDA; on CPU the actor launches a stand-in server module that speaks the
same /health + /get_server_info API and echoes the argv it was started with, so the test sees
exactly which flags reached the process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from miles_platform.cluster.ports import free_port
from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.rollout.sglang_launcher import (
    attach_external_engines,
    build_sglang_command,
    launch_sglang_engines,
    probe_engine,
)

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, sys
    import uvicorn
    from fastapi import FastAPI

    p = argparse.ArgumentParser()
    p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--model-path")
    args, _ = p.parse_known_args()
    app = FastAPI()

    @app.get("/health")
    def health():
        return {}

    @app.get("/get_server_info")
    def server_info():
        return {"tp_size": args.tp_size, "model_path": args.model_path, "argv": sys.argv[1:]}

    uvicorn.run(app, host=args.host, port=args.port, log_level="error")
    """
)


def _cfg(**kw) -> RunConfig:
    base = {
        "rollout_engine": "sglang",
        "hf_checkpoint": "/models/qwen3-0.6b",
        "rollout_num_gpus_per_engine": 2,
    }
    return RunConfig(**{**base, **kw})


def test_command_from_miles_flags():
    cfg = parse_run_config(
        [
            "--rollout-batch-size", "4", "--rollout-engine", "sglang", "--hf-checkpoint", "/m",
            "--rollout-num-gpus-per-engine", "2", "--rollout-num-gpus", "4",
            "--sglang-mem-fraction-static", "0.7", "--sglang-enable-dp-attention", "--sglang-log-level=INFO",
        ]
    )  # fmt: skip
    cmd = build_sglang_command(cfg, port=30001, base_gpu_id=2, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    flags = cmd[3:]
    pairs = dict(zip(flags, flags[1:]))
    assert pairs["--model-path"] == "/m" and pairs["--tp-size"] == "2"
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "30001" and pairs["--base-gpu-id"] == "2"
    assert pairs["--mem-fraction-static"] == "0.7" and pairs["--log-level"] == "INFO"
    i = flags.index("--enable-dp-attention")  # bool True -> bare flag
    assert i == len(flags) - 1 or flags[i + 1].startswith("--")
    assert not any(f.startswith("--sglang-") for f in flags)


def test_passthrough_overrides_and_rejections():
    cmd = build_sglang_command(_cfg(sglang_args={"host": "0.0.0.0", "disable-radix-cache": False}), port=1)
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and cmd.count("--host") == 1
    assert "--disable-radix-cache" not in cmd
    with pytest.raises(ConfigError, match="--sglang-port"):
        build_sglang_command(_cfg(sglang_args={"port": "9"}), port=1)
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine 2"):
        build_sglang_command(_cfg(sglang_args={"tp-size": "4"}), port=1)
    assert "--tp-size" in build_sglang_command(_cfg(sglang_args={"tp-size": "1", "sp-degree": "2"}), port=1)
    with pytest.raises(ConfigError, match="--hf-checkpoint"):
        build_sglang_command(_cfg(hf_checkpoint=None), port=1)


@pytest.fixture
def fake_server_module(tmp_path):
    (tmp_path / "fake_sglang.py").write_text(FAKE_SERVER)
    return tmp_path


def test_attach_external_engine_over_http(fake_server_module):
    port = free_port()
    cmd = [
        sys.executable,
        str(fake_server_module / "fake_sglang.py"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd + ["--tp-size", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        addr = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                probe_engine(addr, timeout_s=1)
                break
            except ConfigError:
                assert time.monotonic() < deadline and proc.poll() is None, "fake engine did not come up"
                time.sleep(0.2)
        engines = attach_external_engines(_cfg(rollout_external_engine_addrs=[addr]))
        assert [e.address for e in engines] == [addr] and engines[0].external and engines[0].tp_size == 2
        with pytest.raises(ConfigError, match="tp_size=2"):
            attach_external_engines(_cfg(rollout_external_engine_addrs=[addr], rollout_num_gpus_per_engine=1))
        dead = f"127.0.0.1:{free_port()}"
        with pytest.raises(ConfigError, match=dead):
            attach_external_engines(_cfg(rollout_external_engine_addrs=[addr, dead]), timeout_s=1)
        with pytest.raises(ConfigError, match="host:port"):
            attach_external_engines(_cfg(rollout_external_engine_addrs=["nohostport"]))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_ray_actor_launches_engine_on_rollout_bundle(fake_server_module, monkeypatch):
    """init_ray (local start) -> placement groups -> engine actor -> server process -> /health."""
    import ray

    from miles_platform.cluster.ray_cluster import create_placement_groups, init_ray, shutdown_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = _cfg(rollout_num_gpus_per_engine=1, rollout_num_gpus=1, sglang_args={"mem-fraction-static": "0.7"})
    ctx = init_ray(cfg)
    try:
        assert ctx.started_local
        groups = create_placement_groups(cfg, use_gpu=False)
        env = {"PYTHONPATH": str(fake_server_module)}
        actors, engines = launch_sglang_engines(
            cfg, groups, module="fake_sglang", env=env, timeout_s=60, use_gpu=False
        )
        assert len(actors) == len(engines) == 1
        argv = engines[0].server_info["argv"]
        assert argv[argv.index("--model-path") + 1] == "/models/qwen3-0.6b"
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.7"
        assert argv[argv.index("--port") + 1] == engines[0].address.rsplit(":", 1)[1]
        assert probe_engine(engines[0].address).server_info["tp_size"] == 1
        assert ray.get(actors[0].stop.remote()) is not None
        assert not ray.get(actors[0].is_alive.remote())
    finally:
        shutdown_ray(ctx)
    assert not ray.is_initialized()
