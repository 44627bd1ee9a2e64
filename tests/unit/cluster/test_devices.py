"""Which device a process computes on, and the defaults that follow from it (cluster/devices.py)."""

from __future__ import annotations

import pytest
import torch

from miles_platform.cluster.devices import config_on_device, forward_dtypes, group_backend, rank_device
from miles_platform.config import ConfigError, RunConfig, parse_run_config


def test_rank_device_is_the_cpu_without_a_gpu_and_what_is_asked_for(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device() == torch.device("cpu")  # no CUDA here: LOCAL_RANK names no GPU
    assert rank_device("auto") == torch.device("cpu")
    assert rank_device("cuda") == torch.device("cuda", 0)  # an index, for set_device and NCCL
    assert rank_device("cuda:2") == torch.device("cuda", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert rank_device() == torch.device("cuda", 3)  # outside Ray: cuda:$LOCAL_RANK


def test_nccl_between_gpu_ranks_gloo_on_the_cpu():
    assert group_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    assert group_backend(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize(
    "train,rollout,device,backend,want",
    [
        (None, None, "cpu", "fsdp", ("fp32", "fp32")),  # the CPU demo: as before
        (None, None, "cuda:0", "fsdp", ("bf16", "bf16")),  # Miles' GPU default
        (None, None, "cuda:0", "megatron", ("fp32", "fp32")),  # megatron trains in fp32 here
        ("fp32", None, "cuda:0", "fsdp", ("fp32", "fp32")),  # one given sets both
        (None, "bf16", "cpu", "fsdp", ("bf16", "bf16")),
    ],
)
def test_forward_dtype_defaults_per_device(train, rollout, device, backend, want):
    assert forward_dtypes(train, rollout, device, backend) == want
    cfg = RunConfig(train_forward_dtype=train, rollout_dtype=rollout, train_backend=backend)
    on = config_on_device(cfg, device)
    assert (on.train_forward_dtype, on.rollout_dtype) == want
    assert (cfg.train_forward_dtype, cfg.rollout_dtype) == (train, rollout)  # the run's config untouched


def test_help_says_each_default_per_device(capsys):
    from miles_platform.config import build_parser

    text = " ".join(build_parser().format_help().split())
    for flag in ("--train-forward-dtype", "--rollout-dtype"):
        assert "bf16 on CUDA with --train-backend fsdp, fp32 on the CPU and with megatron" in text, flag
    assert "(default: on with --colocate, else off" in text


def test_offload_flags_parse_and_refuse_what_cannot_share(tmp_path):
    rbs = ["--rollout-batch-size", "2"]
    cfg = parse_run_config([*rbs, "--colocate", "--no-offload-train", "--offload-rollout-level", "kv_cache"])
    assert cfg.colocate and cfg.offload_train is False and cfg.offload_rollout is None
    assert cfg.offload_rollout_level == ["kv_cache"]
    from miles_platform.cluster.colocation import offload_rollout_on, offload_train_on

    assert not offload_train_on(cfg) and offload_rollout_on(cfg)
    assert offload_train_on(parse_run_config([*rbs, "--offload-train"]))
    with pytest.raises(ConfigError, match="--fully-async keeps the engines generating"):
        RunConfig(
            rollout_batch_size=2, fully_async=True, colocate=True, pause_generation_mode="retract"
        ).validate()
    with pytest.raises(ConfigError, match="--train-forward-dtype bf16 != --rollout-dtype fp32"):
        RunConfig(rollout_batch_size=2, train_forward_dtype="bf16", rollout_dtype="fp32").validate()
