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
    sglang_python,
)

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, os, sys
    import torch, uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    p = argparse.ArgumentParser()
    p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--model-path"); p.add_argument("--dtype", default="auto"); p.add_argument("--api-key")
    p.add_argument("--config")  # SGLang's ConfigArgumentMerger: YAML keys as flags, argv wins
    args, _ = p.parse_known_args()
    if args.config:
        import yaml
        for k, v in yaml.safe_load(open(args.config)).items():
            if getattr(args, k.replace("-", "_"), None) is None:
                setattr(args, k.replace("-", "_"), v)
    app = FastAPI()
    weights = {}

    @app.middleware("http")
    async def auth(request, call_next):  # SGLang's --api-key guards every route but /health*
        if args.api_key and not request.url.path.startswith("/health") \\
                and request.headers.get("authorization") != f"Bearer {args.api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    def health():
        return {}

    @app.get("/get_server_info")
    def server_info():
        return {"tp_size": args.tp_size, "model_path": args.model_path, "argv": sys.argv[1:]}

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        # SGLang 0.5.23: GetWeightsByNameReqInput(name, truncate_size=100) -> the model class's
        # param.cpu().to(float32).tolist()[:truncate_size] (tied lm_head: embed_tokens); a class
        # without get_weights_by_name (Qwen2/Qwen3) answers 400 "Get parameter by name failed"
        body = await request.json()
        if not weights:
            from safetensors.torch import load_file
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
            weights.update((k, v.to(dtype)) for k, v in load_file(os.path.join(args.model_path, "model.safetensors")).items())
        name = body["name"]
        if name == "lm_head.weight" and name not in weights:
            name = "model.embed_tokens.weight"
        if name not in weights:
            return JSONResponse({"error": {"message": "Get parameter by name failed"}}, status_code=400)
        return weights[name].to(torch.float32).tolist()[: body.get("truncate_size", 100)]

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
    assert "--enable-metrics" in flags  # GET /metrics, as the embedded engine's


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


def test_rollout_dtype_reaches_sglang_as_dtype():
    """SGLang's default --dtype auto serves the checkpoint's dtype; the trainer compares against
    --rollout-dtype, so the launcher passes it on (and refuses a contradicting --sglang-dtype)."""
    base = ["--rollout-batch-size", "4", "--rollout-engine", "sglang", "--hf-checkpoint", "/m"]
    default = build_sglang_command(parse_run_config(base), port=1, python="python")
    assert default[default.index("--dtype") + 1] == "float32"
    bf16 = parse_run_config([*base, "--rollout-dtype", "bf16", "--train-forward-dtype", "bf16"])
    cmd = build_sglang_command(bf16, port=1, python="python")
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd.count("--dtype") == 1
    same = parse_run_config([*base, "--rollout-dtype", "bf16", "--train-forward-dtype", "bf16",
                             "--sglang-dtype", "bfloat16"])  # fmt: skip
    assert build_sglang_command(same, port=1).count("--dtype") == 1
    with pytest.raises(ConfigError, match="--sglang-dtype half contradicts --rollout-dtype bf16"):
        build_sglang_command(_cfg(rollout_dtype="bf16", sglang_args={"dtype": "half"}), port=1)


def test_sglang_interpreter_from_environment(monkeypatch):
    monkeypatch.delenv("MILES_SGLANG_PYTHON", raising=False)
    assert sglang_python() == sys.executable
    monkeypatch.setenv("MILES_SGLANG_PYTHON", "/opt/sglang-venv/bin/python")
    assert sglang_python() == "/opt/sglang-venv/bin/python"


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


def _start_fake(module_dir, *flags: str, api_key: str | None = None):
    """The stand-in server as a process on a free loopback port, once it answers /health."""
    port = free_port()
    cmd = [sys.executable, str(module_dir / "fake_sglang.py"), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen([*cmd, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    addr, deadline = f"127.0.0.1:{port}", time.monotonic() + 30
    while True:
        try:
            probe_engine(addr, api_key, timeout_s=1)
            return proc, addr
        except ConfigError:
            assert time.monotonic() < deadline and proc.poll() is None, "fake engine did not come up"
            time.sleep(0.2)


def test_weight_check_over_http_against_stand_in_sglang(fake_server_module, tiny_hf_checkpoint):
    """--check-weight-update-equal reads an SGLang engine through /get_weights_by_name with the run's
    bearer token: equal in the serving dtype passes, one changed tensor is named, a wrong dtype or a
    missing token fails instead of passing silently."""
    from safetensors.torch import load_file

    from miles_platform.weights.equality import first_mismatch

    proc, addr = _start_fake(fake_server_module, "--model-path", tiny_hf_checkpoint, "--dtype", "bfloat16",
                             "--api-key", "s3cret", api_key="s3cret")  # fmt: skip
    try:
        url, weights = f"http://{addr}", load_file(f"{tiny_hf_checkpoint}/model.safetensors")
        assert first_mismatch(url, weights, "bf16", api_key="s3cret") is None
        changed = dict(weights)
        changed["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"] + 0.25
        why = first_mismatch(url, changed, "bf16", api_key="s3cret")
        assert "model.layers.1.mlp.down_proj.weight differs" in why
        assert "differs" in first_mismatch(url, weights, "fp32", api_key="s3cret")  # served bf16, not fp32
        assert "401" in first_mismatch(url, weights, "bf16", api_key=None)
        unknown = first_mismatch(
            url, {"no.such.weight": weights["model.norm.weight"]}, "bf16", api_key="s3cret"
        )
        assert (
            "did not return tensor no.such.weight" in unknown
            and "--ci-disable-weight-update-checker" in unknown
        )
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_ray_actor_launches_engine_on_rollout_bundle(fake_server_module, monkeypatch):
    """init_ray -> placement groups -> engine actor -> server process -> /health, on the worker's
    shared local Ray (a private local start: test_local_ray.py)."""
    import ray

    from miles_platform.cluster.ray_cluster import create_placement_groups, init_ray, remove_placement_groups

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = _cfg(rollout_num_gpus_per_engine=1, rollout_num_gpus=1, sglang_args={"mem-fraction-static": "0.7"})
    init_ray(cfg)
    groups, actors = create_placement_groups(cfg, use_gpu=False), []
    try:
        env = {"PYTHONPATH": str(fake_server_module)}
        actors, engines = launch_sglang_engines(
            cfg, groups, module="fake_sglang", env=env, timeout_s=60, use_gpu=False
        )
        assert len(actors) == len(engines) == 1
        argv = engines[0].server_info["argv"]
        assert argv[argv.index("--model-path") + 1] == "/models/qwen3-0.6b"
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.7"
        assert argv[argv.index("--dtype") + 1] == "float32"  # --rollout-dtype fp32
        assert argv[argv.index("--port") + 1] == engines[0].address.rsplit(":", 1)[1]
        assert probe_engine(engines[0].address).server_info["tp_size"] == 1
        assert ray.get(actors[0].stop.remote()) is not None
        assert not ray.get(actors[0].is_alive.remote())
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_groups(groups)


def test_the_engine_log_is_private_and_never_follows_a_planted_link(
    fake_server_module, monkeypatch, tmp_path
):
    """Logs went to a fixed /tmp/miles_sglang that another local user could pre-create or fill with
    links (issue #49, item 8): now a fresh 0700 dir and a 0600 file opened with O_NOFOLLOW."""
    import os
    import stat

    import ray

    from miles_platform.rollout import sglang_launcher
    from miles_platform.rollout.sglang_launcher import SGLangEngineActor

    def mode(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])  # the actor's own call, here outside Ray
    monkeypatch.delenv("MILES_SGLANG_LOG_DIR", raising=False)
    actor = SGLangEngineActor(_cfg(), module="fake_sglang", env={"PYTHONPATH": str(fake_server_module)})
    out = actor.start(timeout_s=60)
    try:
        log_dir = os.path.dirname(out["log_path"])
        assert os.path.basename(log_dir).startswith("miles_sglang_") and mode(log_dir) == 0o700
        assert mode(out["log_path"]) == 0o600 and os.path.getsize(out["log_path"]) >= 0
    finally:
        actor.stop()
    port = free_port()
    monkeypatch.setattr(sglang_launcher, "free_port", lambda host=None: port)
    monkeypatch.setenv("MILES_SGLANG_LOG_DIR", str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("")
    (tmp_path / f"engine_0_{port}.log").symlink_to(victim)
    with pytest.raises(OSError):
        SGLangEngineActor(_cfg(), module="fake_sglang", env={"PYTHONPATH": str(fake_server_module)}).start(10)
    assert victim.read_text() == ""


def test_the_run_key_reaches_sglang_in_a_private_file_never_in_argv(
    fake_server_module, monkeypatch, tmp_path
):
    """The launcher passed `--api-key <run secret>` in argv, which `ps` shows every local user
    (issue #49, item 8): now a 0600 YAML file passed as `--config`, merged with the user's own
    `--sglang-config` file; the server still enforces the key."""
    import os
    import stat

    import httpx
    import ray

    from miles_platform.rollout.sglang_launcher import SGLangEngineActor

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    monkeypatch.setenv("MILES_SGLANG_LOG_DIR", str(tmp_path / "logs"))
    user_cfg = tmp_path / "user.yaml"
    user_cfg.write_text("mem-fraction-static: 0.6\n")
    cfg = _cfg(api_key="s3cret-key", sglang_args={"config": str(user_cfg)})
    actor = SGLangEngineActor(cfg, module="fake_sglang", env={"PYTHONPATH": str(fake_server_module)})
    out = actor.start(timeout_s=60)
    try:
        assert not any("s3cret-key" in a for a in out["command"])
        with open(f"/proc/{actor.proc.pid}/cmdline", "rb") as f:
            assert b"s3cret-key" not in f.read()
        secret_file = out["command"][out["command"].index("--config") + 1]
        assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600 and secret_file != str(user_cfg)
        text = open(secret_file).read()
        assert "s3cret-key" in text and "mem-fraction-static: 0.6" in text
        url = f"http://{out['address']}/get_server_info"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
    finally:
        actor.stop()
    with pytest.raises(ConfigError, match="--sglang-api-key"):
        build_sglang_command(
            _cfg(api_key="k", sglang_args={"api-key": "x"}), port=1, secret_dir=str(tmp_path)
        )
